"""The plugin contract's manifest, pagedllm/contract/manifest.json, held against the code.

The manifest lists every member a plugin may implement or call (``SURFACE``: the contract
package, the reference room, the worker hooks and the types they pass), each with its kind, its
signature, the plugin API version it appeared in and the old import paths that still reach it;
and the deprecated members with the version that removes them. The compatibility rule it
enforces (docs/porting.md, "Compatibility promise"): within a major version a member is never
removed and its signature changes only in ways every existing caller and override survives
(new parameters with defaults); removal takes a major version and one release of deprecation
before it.

    python tools/contract_manifest.py           # check (tests/contract/test_manifest.py runs it)
    python tools/contract_manifest.py --write   # record new members (since: PLUGIN_API_VERSION)
                                                # and compatible signature changes
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

MANIFEST = Path(__file__).resolve().parent.parent / "pagedllm" / "contract" / "manifest.json"

# (module or class, its members in the contract): "*" = every public name the class itself
# defines (and __init__), a tuple = those names. "self.x" names an instance attribute that
# __init__ sets.
SURFACE: list[tuple[str, Any]] = [
    ("pagedllm.contract.version", ("PLUGIN_API_VERSION", "PluginAPIDeprecationWarning",
                                   "api_incompatibility")),
    ("pagedllm.contract.capabilities.Capabilities", "*"),
    ("pagedllm.contract.attention", ("ATTENTION_FEATURES",)),
    ("pagedllm.contract.attention.AttentionMetadata", "*"),
    ("pagedllm.contract.attention.AttentionImpl",
     ("*", "self.num_heads", "self.head_size", "self.num_kv_heads", "self.scale",
      "self.sliding_window", "self.logits_soft_cap", "self.kv_cache_dtype")),
    ("pagedllm.contract.cache_ops", ("as_bytes",)),
    ("pagedllm.contract.cache_ops.CacheOps", "*"),
    ("pagedllm.contract.cache_ops.CacheTransfer", "*"),
    ("pagedllm.contract.layer_fences", ("add", "consume", "consume_all", "pending")),
    ("pagedllm.contract.ops", ("OP_NAMES",)),
    ("pagedllm.contract.ops.OpTable", "*"),
    ("pagedllm.contract.quantization", ("QUANTIZATION_METHOD_NAMES", "ACT_NONE",
                                        "ACT_FP8_PER_TOKEN", "FP8_MAX")),
    ("pagedllm.contract.backend.Backend", "*"),
    ("pagedllm.contract.registry", ("ENTRY_POINT_GROUP", "discover", "resolve_backend",
                                    "load_class", "is_backend_class")),
    ("pagedllm.contract.registry.BackendInfo", "*"),
    ("pagedllm.contract.lora", ("NO_LORA",)),
    ("pagedllm.contract.lora.LoRAMapping", "*"),
    ("pagedllm.reference.attention", ("kv_cache_shape", "scatter_kv")),
    ("pagedllm.reference.lora", ("lora_shrink", "lora_expand")),
    ("pagedllm.reference.kv_transfer", ("block_nbytes", "export_blocks", "import_blocks")),
    ("pagedllm.reference.attention.TorchPagedAttention", ("k_scale", "v_scale", "gather")),
    ("pagedllm.reference.ops", ("Ops", "rms_norm", "gemma_rms_norm", "rotary", "fused_moe",
                                "fused_moe_prepare", "silu_and_mul", "gelu_tanh_and_mul",
                                "linear", "linear_prepare", "greedy_logprobs",
                                "apply_token_bitmask", "quant_linear", "quant_linear_prepare")),
    ("pagedllm.worker.worker", ("GiB",)),
    # the hooks docs/porting.md section 5 names, and what a hook reaches on self
    ("pagedllm.worker.worker.Worker",
     ("__init__", "select_device", "available_kv_bytes", "allocate_device_cache",
      "allocate_host_cache", "after_cache_init", "run_model", "launch_model", "load_model",
      "self.config", "self.backend", "self.device", "self.dtype", "self.model", "self.runner",
      "self.kv_caches", "self.counters")),
    ("pagedllm.worker.model_runner.ModelRunner", ("prepare", "forward", "sample")),
    ("pagedllm.worker.model_runner.ModelInput", ("input_ids", "positions", "metadata")),
    ("pagedllm.worker.pending.PendingOutputs", ("done", "result")),
    ("pagedllm.core.batch", ("ScheduledBatch", "SeqOutput")),
]
# old import paths (plugin API 1.0-2.0) that keep reaching the same objects
ALIASES: dict[str, tuple[str, ...]] = {
    "pagedllm.backends.PLUGIN_API_VERSION": ("pagedllm.contract.version.PLUGIN_API_VERSION",),
    "pagedllm.backends.interface": ("Backend", "BackendInfo", "Capabilities", "CacheOps",
                                    "as_bytes", "AttentionImpl", "AttentionMetadata"),
    "pagedllm.backends.attention": ("ATTENTION_FEATURES", "AttentionImpl", "AttentionMetadata"),
    "pagedllm.backends.registry": ("ENTRY_POINT_GROUP", "discover", "resolve_backend",
                                   "api_incompatibility", "BackendInfo"),
    "pagedllm.models.layers.ops": ("Ops", "rms_norm", "gemma_rms_norm", "rotary", "silu_and_mul",
                                   "gelu_tanh_and_mul", "linear", "linear_prepare",
                                   "greedy_logprobs", "apply_token_bitmask"),
    "pagedllm.backends.cpu.attention": ("TorchPagedAttention",),
}


def _resolve(path: str) -> Any:
    """The object a dotted path names (a module, or attributes below one)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def _annotation(owner: type, name: str) -> str:
    for klass in owner.__mro__:
        ann = vars(klass).get("__annotations__", {})
        if name in ann:
            value = ann[name]
            return value if isinstance(value, str) else inspect.formatannotation(value)
    return ""


def _instance_attributes(cls: type) -> set[str]:
    """Names ``__init__`` (of the class or a base) assigns on self."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                        and t.value.id == "self":
                    names.add(t.attr)
    return names


def describe(owner: Any, name: str) -> tuple[str, str]:
    """(kind, signature) of member ``name`` of module or class ``owner``."""
    if name.startswith("self."):
        attr = name[5:]
        if attr not in _instance_attributes(owner):
            raise AttributeError(f"{owner.__qualname__}.__init__ does not set self.{attr}")
        return "instance attribute", _annotation(owner, attr)
    if inspect.isclass(owner):
        if dataclasses.is_dataclass(owner) and name in {f.name for f in dataclasses.fields(owner)}:
            f = next(f for f in dataclasses.fields(owner) if f.name == name)
            default = ("" if f.default is dataclasses.MISSING and f.default_factory is
                       dataclasses.MISSING else f" = {f.default!r}" if f.default is not
                       dataclasses.MISSING else f" = {f.default_factory.__name__}()")
            return "field", f"{_annotation(owner, name)}{default}"
        try:
            raw = inspect.getattr_static(owner, name)
        except AttributeError:  # declared, no value: each subclass sets it
            if name not in vars(owner).get("__annotations__", {}):
                raise
            return "attribute", _annotation(owner, name)
        if isinstance(raw, classmethod):
            return "classmethod", str(inspect.signature(raw.__func__))
        if isinstance(raw, staticmethod):
            return "staticmethod", str(inspect.signature(raw.__func__))
        if isinstance(raw, property):
            return "property", str(inspect.signature(raw.fget))
        if inspect.isfunction(raw):
            abstract = getattr(raw, "__isabstractmethod__", False)
            return ("abstract method" if abstract else "method"), str(inspect.signature(raw))
        ann = _annotation(owner, name)
        return "attribute", f"{ann} = {raw!r}" if ann else repr(raw)
    obj = getattr(owner, name)
    if inspect.isclass(obj):
        return "class", ""
    if inspect.isfunction(obj):
        return "function", str(inspect.signature(obj))
    if name == "PLUGIN_API_VERSION":  # its value is the manifest's version
        return "constant", "str"
    return "constant", repr(obj)


def collect() -> dict[str, dict[str, str]]:
    """Every member of SURFACE as the code has it: name -> {kind, signature}."""
    out: dict[str, dict[str, str]] = {}
    for path, members in SURFACE:
        owner = _resolve(path)
        names = list(members) if not isinstance(members, str) else [members]
        if inspect.isclass(owner):  # the class itself is a member
            out[path] = {"kind": "class", "signature": ""}
        if "*" in names:
            names.remove("*")
            own = list(dict.fromkeys(
                [n for n in vars(owner).get("__annotations__", {}) if not n.startswith("_")]
                + [n for n in vars(owner) if not n.startswith("_")]))
            if "__init__" in vars(owner) and not getattr(owner, "_is_protocol", False):
                own.append("__init__")
            if dataclasses.is_dataclass(owner):
                own += [f.name for f in dataclasses.fields(owner) if f.name not in own]
            names = own + names
        for name in names:
            kind, signature = describe(owner, name)
            out[f"{path}.{name}"] = {"kind": kind, "signature": signature}
    return out


def collect_aliases() -> dict[str, str]:
    """Old path -> canonical member, for every alias that reaches the same object."""
    canonical = {}
    for name in collect():
        if "self." in name:
            continue
        try:
            canonical[id(_resolve(name))] = name
        except AttributeError:
            continue
    out = {}
    for module, names in ALIASES.items():
        if module.endswith(".PLUGIN_API_VERSION"):
            out[module] = names[0]
            continue
        for name in names:
            obj = _resolve(f"{module}.{name}")
            target = canonical.get(id(obj))
            if target is None and isinstance(obj, (str, int, float, tuple)):
                target = next((n for n in canonical.values()
                               if n.rsplit(".", 1)[1] == name), None)
            if target is None:
                raise LookupError(f"alias {module}.{name} reaches nothing in SURFACE")
            out[f"{module}.{name}"] = target
    return out


def _version(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


def _value_compatible(old: str, new: str) -> bool:
    """A value recorded for a constant, attribute or field: a tuple may gain entries and a
    dataclass instance (``Capabilities(...)``) new fields; everything else stays as it was."""
    if old == new:
        return True
    try:
        was, now = ast.literal_eval(old), ast.literal_eval(new)
        return isinstance(was, tuple) and isinstance(now, tuple) and all(x in now for x in was)
    except (ValueError, SyntaxError):
        pass
    try:
        was_call, now_call = ast.parse(old, mode="eval").body, ast.parse(new, mode="eval").body
    except SyntaxError:
        return False
    if not (isinstance(was_call, ast.Call) and isinstance(now_call, ast.Call)) \
            or ast.unparse(was_call.func) != ast.unparse(now_call.func) or was_call.args:
        return False
    now_kw = {k.arg: ast.unparse(k.value) for k in now_call.keywords}
    return all(now_kw.get(k.arg) == ast.unparse(k.value) for k in was_call.keywords)


def compatible(kind: str, old: str, new: str) -> bool:
    """Whether a plugin written against ``old`` keeps working with ``new``. A callable must
    accept every call the old one accepted and keep every name an override defines: the old
    parameters in order, same kinds and defaults, and any new one optional (a default, *args or
    **kwargs). A value (constant, attribute, field) may only grow (``_value_compatible``)."""
    if kind not in ("function", "method", "abstract method", "classmethod", "staticmethod",
                    "property"):
        head_old, _, value_old = old.partition(" = ")
        head_new, _, value_new = new.partition(" = ")
        if kind == "constant":
            return _value_compatible(old, new)
        return head_old == head_new and _value_compatible(value_old, value_new)

    def params(sig: str) -> list[tuple[str, str, str | None]]:
        src = f"def f{sig.split(' -> ')[0]}: pass"
        try:
            tree = ast.parse(src)
        except SyntaxError:
            return []
        args = tree.body[0].args
        out = []
        positional = args.posonlyargs + args.args
        defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
        for a, d in zip(positional, defaults):
            out.append((a.arg, "pos", None if d is None else ast.unparse(d)))
        if args.vararg:
            out.append((args.vararg.arg, "*", "()"))
        for a, d in zip(args.kwonlyargs, args.kw_defaults):
            out.append((a.arg, "kw", None if d is None else ast.unparse(d)))
        if args.kwarg:
            out.append((args.kwarg.arg, "**", "{}"))
        return out

    before, after = params(old), params(new)
    if not before and not after:
        return old == new
    positional_before = [p for p in before if p[1] == "pos"]
    positional_after = [p for p in after if p[1] == "pos"]
    if positional_after[:len(positional_before)] != positional_before:
        return False
    kept = {p[0]: p for p in after}
    if any(kept.get(p[0]) != p for p in before):
        return False
    added = [p for p in after if p not in before]
    return all(p[2] is not None for p in added)


def check(code: dict[str, dict[str, str]], aliases: dict[str, str], manifest: dict[str, Any],
          current: str) -> list[str]:
    """What is wrong between the code and the manifest, one sentence each (empty: they agree)."""
    problems = []
    if manifest.get("plugin_api_version") != current:
        problems.append(f"the manifest is for plugin API {manifest.get('plugin_api_version')}, "
                        f"the code's PLUGIN_API_VERSION is {current}")
    members = manifest.get("members", {})
    deprecated = {d["name"]: d for d in manifest.get("deprecated", [])}
    for name, entry in members.items():
        since = entry.get("since", "")
        if not since or _version(since) > _version(current):
            problems.append(f"{name}: since={since!r} must be a version <= {current}")
        if name not in code:
            dep = deprecated.get(name)
            if dep is None:
                problems.append(f"{name} is gone from the code without a deprecation: restore it, "
                                "or deprecate it (warn_deprecated) for a release first")
            elif _version(current) < _version(dep["removed_in"]):
                problems.append(f"{name} is deprecated until {dep['removed_in']} but already "
                                f"gone in {current}")
        elif code[name]["signature"] != entry.get("signature") or \
                code[name]["kind"] != entry.get("kind"):
            was = f"{entry.get('kind')} {entry.get('signature')}"
            now = f"{code[name]['kind']} {code[name]['signature']}"
            ok = (entry.get("kind") == code[name]["kind"]
                  and compatible(entry["kind"], entry.get("signature", ""),
                                 code[name]["signature"]))
            problems.append(f"{name} changed from {was!r} to {now!r}: "
                            + ("compatible (run tools/contract_manifest.py --write)" if ok else
                               "INCOMPATIBLE with plugins written for it: keep the old form "
                               "(new parameters need defaults, values may only grow), or "
                               "deprecate it"))
    for name in code:
        if name not in members:
            problems.append(f"{name} is new: record it (tools/contract_manifest.py --write), "
                            f"since={current}, and bump PLUGIN_API_VERSION's minor if a "
                            "released version lacks it")
    for name, dep in deprecated.items():
        if _version(dep["removed_in"])[0] <= _version(dep["since"])[0]:
            problems.append(f"{name}: removed_in={dep['removed_in']} must be a later major "
                            f"version than since={dep['since']}")
    recorded = manifest.get("aliases", {})
    for old, target in aliases.items():
        if recorded.get(old) != target:
            problems.append(f"alias {old} -> {target} is not recorded in the manifest")
    for old in recorded:
        if old not in aliases:
            problems.append(f"alias {old} is gone: old import paths stay until a major version")
    return problems


def write(code: dict[str, dict[str, str]], aliases: dict[str, str], manifest: dict[str, Any],
          current: str) -> dict[str, Any]:
    """The manifest with new members (since=current) and compatible changes recorded; raises
    ValueError for an incompatible change or a removal without deprecation."""
    members = dict(manifest.get("members", {}))
    for name, entry in members.items():
        if name not in code:
            continue
        now = code[name]
        if (now["kind"], now["signature"]) != (entry["kind"], entry["signature"]):
            if now["kind"] != entry["kind"] or not compatible(entry["kind"], entry["signature"],
                                                              now["signature"]):
                raise ValueError(f"{name}: {entry['signature']!r} -> {now['signature']!r} is "
                                 "incompatible; not recorded")
            members[name] = {**entry, **now}
    for name, now in code.items():
        members.setdefault(name, {**now, "since": current})
    deprecated = {d["name"] for d in manifest.get("deprecated", [])}
    gone = [n for n in members if n not in code and n not in deprecated]
    if gone:
        raise ValueError(f"removed without deprecation: {', '.join(gone)}")
    return {"plugin_api_version": current,
            "members": {n: members[n] for n in code if n in members}
            | {n: members[n] for n in members if n not in code},
            "aliases": {old: aliases[old] for old in sorted(aliases)},
            "deprecated": manifest.get("deprecated", [])}


def dumps(manifest: dict[str, Any]) -> str:
    """The manifest as JSON with one line per member (readable diffs)."""
    def block(key: str, rows: list[str], open_: str, close: str) -> str:
        return f' "{key}": {open_}\n' + ",\n".join(rows) + f"\n {close}"

    members = [f"  {json.dumps(n)}: {json.dumps(e)}" for n, e in manifest["members"].items()]
    aliases = [f"  {json.dumps(n)}: {json.dumps(t)}" for n, t in manifest["aliases"].items()]
    deprecated = [f"  {json.dumps(d)}" for d in manifest["deprecated"]]
    parts = [f' "plugin_api_version": {json.dumps(manifest["plugin_api_version"])}',
             block("members", members, "{", "}"), block("aliases", aliases, "{", "}"),
             block("deprecated", deprecated, "[", "]") if deprecated else ' "deprecated": []']
    return "{\n" + ",\n".join(parts) + "\n}\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true",
                        help="record new members and compatible changes in the manifest")
    args = parser.parse_args()
    from pagedllm.contract.version import PLUGIN_API_VERSION

    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}
    code, aliases = collect(), collect_aliases()
    if args.write:
        MANIFEST.write_text(dumps(write(code, aliases, manifest, PLUGIN_API_VERSION)))
        print(f"wrote {MANIFEST}")
        return 0
    problems = check(code, aliases, manifest, PLUGIN_API_VERSION)
    print("\n".join(problems) or f"{MANIFEST.name}: {len(code)} members agree with the code")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
