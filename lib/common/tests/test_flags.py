"""cilia_common.flags helpers outside the model-flag generator."""

from __future__ import annotations

import pytest


def test_require_all_or_none_names_every_flag_of_a_partly_given_group() -> None:
    from cilia_common.flags import require_all_or_none

    require_all_or_none({"--a": "", "--b": []})
    require_all_or_none({"--a": "x", "--b": ["y"]})
    with pytest.raises(ValueError, match=r"^--a and --b: give both or none$"):
        require_all_or_none({"--a": "x", "--b": None})
    with pytest.raises(
        ValueError, match=r"^--a, --b and --c: give all three \(mutual TLS\) or none$"
    ):
        require_all_or_none({"--a": "", "--b": "y", "--c": ""}, "mutual TLS")
