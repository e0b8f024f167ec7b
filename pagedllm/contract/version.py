"""The plugin contract's version and the compatibility rule between a plugin and the engine.

``PLUGIN_API_VERSION`` is "major.minor". A plugin states the version it was written for
(``Backend.plugin_api_version``). Same major and a minor no newer than ours: it runs unchanged
(a minor release only adds optional surface with safe defaults). A member is removed only in a
major release, after at least one release in which using it warns (``warn_deprecated``) naming
the member, the version that removes it and what to use instead. The changelog and the promise:
docs/porting.md; the members and the version each appeared in: manifest.json.
"""
from __future__ import annotations

import warnings

PLUGIN_API_VERSION = "2.3"


class PluginAPIDeprecationWarning(DeprecationWarning):
    """A plugin uses a contract member that a later major version removes."""


def parse_version(text: str) -> tuple[int, int]:
    """"2.1" -> (2, 1); "2" -> (2, 0). ValueError when not "major.minor"."""
    major, _, minor = str(text).partition(".")
    return int(major), int(minor or 0)


def api_incompatibility(stated: str | None, current: str | None = None) -> str | None:
    """Why a plugin written for plugin API ``stated`` cannot load on ``current`` (default:
    PLUGIN_API_VERSION); None: it can.

    Same major and a minor no newer than ours: compatible (minors only add optional surface
    with safe defaults). Not stated: accepted (the plugin predates versioning)."""
    current = current or PLUGIN_API_VERSION
    if stated is None:
        return None
    try:
        want, have = parse_version(stated), parse_version(current)
    except ValueError:
        return (f"refused: plugin_api_version={stated!r} is not 'major.minor'; this pagedllm "
                f"implements plugin API {current}")
    if want[0] != have[0]:
        return (f"refused: written for plugin API {stated}, this pagedllm implements {current} "
                f"(major versions must match); install a plugin release for API {have[0]}.x or "
                f"a pagedllm implementing {want[0]}.x (changelog: docs/porting.md)")
    if want[1] > have[1]:
        return (f"refused: written for plugin API {stated}, newer than this pagedllm's {current}; "
                "upgrade pagedllm")
    return None


def warn_deprecated(member: str, since: str, removed_in: str, use: str,
                    stacklevel: int = 3) -> None:
    """Warn that contract member ``member`` (a dotted name) is deprecated since plugin API
    ``since`` and goes away in ``removed_in``; ``use`` names the replacement."""
    warnings.warn(f"{member} is deprecated since plugin API {since} and is removed in "
                  f"{removed_in}; use {use}", PluginAPIDeprecationWarning, stacklevel=stacklevel)
