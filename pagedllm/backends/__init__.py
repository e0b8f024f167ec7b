"""Hardware backends: the plugin contract (interface.py, attention.py) and the built-in plugins."""

# The plugin contract's version, "major.minor". A plugin states the version it was written for
# (``Backend.plugin_api_version``); the registry refuses a plugin of another major version. Minor
# versions only add optional surface with safe defaults. The changelog is in docs/porting.md.
PLUGIN_API_VERSION = "2.0"
