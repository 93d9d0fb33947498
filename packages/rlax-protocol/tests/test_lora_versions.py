"""The metadata of a LoRA run's versions (`rlax_protocol.lora_versions`) and the content digest."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from rlax_protocol.lora_versions import (
    LORA_RANK,
    LORA_SCALE,
    LORA_TARGETS,
    LoraLayout,
    LoraVersionError,
    lora_layout_of,
    tree_sha256,
)


def test_the_digest_follows_content_not_insertion_order_and_sees_dtype_shape_and_bytes() -> None:
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    one = tree_sha256({"a": w, "b": {"c": np.ones(3, np.float32)}})
    assert one == tree_sha256({"b": {"c": np.ones(3, np.float32)}, "a": w.copy()})
    assert one != tree_sha256({"a": w.reshape(4, 3), "b": {"c": np.ones(3, np.float32)}})
    assert one != tree_sha256({"a": w.astype(ml_dtypes.bfloat16), "b": {"c": np.ones(3, np.float32)}})
    changed = w.copy()
    changed[2, 3] = np.nextafter(changed[2, 3], np.float32(100))
    assert one != tree_sha256({"a": changed, "b": {"c": np.ones(3, np.float32)}})


def test_a_layout_is_read_and_bad_ones_are_named() -> None:
    good = {LORA_RANK: 4, LORA_TARGETS: ["q_proj", "v_proj"], LORA_SCALE: 2.0}
    assert lora_layout_of(good) == LoraLayout(4, ("q_proj", "v_proj"), 2.0)
    assert lora_layout_of({"step": 0}) is None
    bad: list[tuple[dict[str, Any], str]] = [
        ({**good, LORA_RANK: 0}, "lora_rank=0"),
        ({**good, LORA_RANK: True}, "lora_rank=True"),
        ({**good, LORA_TARGETS: []}, "lora_targets"),
        ({**good, LORA_TARGETS: ["q_proj", "q_proj"]}, "distinct"),
        ({**good, LORA_TARGETS: ["../x"]}, "lora_targets"),
        ({**good, LORA_SCALE: float("nan")}, "positive number"),
    ]
    for metadata, needle in bad:
        with pytest.raises(LoraVersionError, match=needle):
            lora_layout_of(metadata)
