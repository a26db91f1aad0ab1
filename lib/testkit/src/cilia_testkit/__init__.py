"""Cilia's test and dev kit (a pytest plugin): one place for what every suite needs.

- :mod:`cilia_testkit.skips`: skip reasons (root, BPF, netns, binaries, Docker); in CI
  (``CILIA_REQUIRE_PRIVILEGED=1``) a missing requirement fails instead of skipping.
- :mod:`cilia_testkit.redis`: :class:`~cilia_testkit.redis.RedisServer`, the one place that
  starts ``redis-server`` for tests, benches and the stack.
- :mod:`cilia_testkit.procs`: child processes without ``preexec_fn``; log lines; kill and reap.

Standard library + pytest only.
"""
