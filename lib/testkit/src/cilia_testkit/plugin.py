"""The pytest entry point (``[project.entry-points.pytest11]``) of the test kit.

Fixtures and hooks shared by every suite are registered here; the modules themselves
(:mod:`cilia_testkit.skips`, :mod:`cilia_testkit.redis`, :mod:`cilia_testkit.procs`) are
plain imports and work outside pytest too (benches, the demo).
"""

from __future__ import annotations
