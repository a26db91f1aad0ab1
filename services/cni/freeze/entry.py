"""The frozen ``cilia-cni``'s script (services/cni/freeze/build.py hands it to PyInstaller).

The same ``main()`` the venv launcher and ``python -m cilia_cni`` run; nothing else happens
here, so the frozen binary and the launcher answer every invocation alike.
"""

from cilia_cni.__main__ import main

main()
