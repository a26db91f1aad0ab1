# PyInstaller hook (services/cni/freeze/build.py --additional-hooks-dir): collect `google.rpc` as
# .pyc files in the bundle's support directory instead of the compressed PYZ archive, so the
# interpreter's own path finder imports them (no per-import decompression through
# PyInstaller's pure-Python importer); measured in services/cni/README.md "Frozen binary".
module_collection_mode = "pyc"
