"""The UI's tests: ``flows.py`` (flow messages) and ``fake_relay.py`` (an Observer server)
sit in this folder, which pytest puts on ``sys.path`` for them."""
