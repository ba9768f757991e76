"""FP8Stats's pieces: its TE debug config, names, amax/scale metrics and arguments
(``fp8_lightning/fp8/stats.py``; the live run is a GPU test)."""

import re
from types import SimpleNamespace

import pytest
import torch
import yaml

from fp8_lightning.fp8.stats import (BF16_SUFFIX, FP8Stats, debug_config, default_stats,
                                     scaling_stats, tensor_stat_metrics)


# ----------------------------------------------------------------------------- FP8Stats pieces
def test_fp8_stats_debug_config_matches_fp8_layers_only():
    config = debug_config(50, ["activation", "gradient"], default_stats("delayed"))
    section = config["fp8_lightning_fp8_stats"]
    feature = section["transformer_engine"]["LogFp8TensorStats"]
    assert feature == {"enabled": True, "tensors": ["activation", "gradient"],
                       "stats": ["underflows%", "overflows%"], "freq": 50}
    pattern = re.compile(section["layers"]["layer_name_regex_pattern"])
    assert pattern.search("blocks.3.qkv") and pattern.search("blocks.3.mlp.fc2")
    assert not pattern.search("lm_head" + BF16_SUFFIX)
    assert not pattern.search("blocks.0.qkv" + BF16_SUFFIX + ".fc1")
    only = re.compile(debug_config(1, ["weight"], ["underflows%"], layers=r"blocks\.(0|11)\.")
                      ["fp8_lightning_fp8_stats"]["layers"]["layer_name_regex_pattern"])
    assert only.search("blocks.11.proj") and not only.search("blocks.1.proj")
    assert default_stats("current") == ["underflows%"]
    yaml.safe_load(yaml.safe_dump(config))  # what the callback writes


def test_fp8_stats_names_from_te():
    metrics = tensor_stat_metrics({"blocks.0.qkv_activation_underflows%": torch.tensor(0.25),
                                   "blocks.1.mlp.fc2_gradient_underflows%": 1.5,
                                   "blocks.0.qkv_gradient_underflows%": 0.5,
                                   "lm_head_weight_scale_inv_min": 0.125})
    assert metrics == {
        "fp8_underflows_pct/blocks.0.qkv.activation": 0.25,
        "fp8_underflows_pct/blocks.1.mlp.fc2.gradient": 1.5,
        "fp8_underflows_pct/blocks.0.qkv.gradient": 0.5,
        "fp8_scale_inv_min/lm_head.weight": 0.125,
        "fp8_underflows_pct/all_layers_max.activation": 0.25,
        "fp8_underflows_pct/all_layers_max.gradient": 1.5,
        "fp8_scale_inv_min/all_layers_max.weight": 0.125,
    }


def test_fp8_stats_amax_and_scale_from_fp8_meta():
    def meta(history, scale):
        return SimpleNamespace(amax_history=torch.tensor(history), scale=torch.tensor(scale))

    linear = SimpleNamespace(fp8_meta={  # one GEMM: fwd [input, weight, output], bwd [dgrad, -]
        "num_gemms": 1,
        "scaling_fwd": meta([[1.0, 0.5, 0.0], [3.0, 0.25, 0.0]], [100.0, 800.0, 1.0]),
        "scaling_bwd": meta([[1e-3, 0.0], [2e-3, 0.0]], [2e7, 1.0])})
    mlp = SimpleNamespace(fc1_weight=None, fp8_meta={
        "num_gemms": 2,
        "scaling_fwd": meta([[1, 2, 0, 3, 4, 0]], [10, 20, 1, 30, 40, 1]),
        "scaling_bwd": meta([[5, 0, 6, 0]], [50, 1, 60, 1])})
    not_fp8 = SimpleNamespace(fp8_meta={"fp8_checkpoint": False})
    stats = scaling_stats({"blocks.0.qkv": linear, "blocks.0.mlp": mlp, "lm_head": not_fp8})
    assert stats["fp8_amax/blocks.0.qkv.input"] == 3.0  # max over the history window
    assert stats["fp8_amax/blocks.0.qkv.weight"] == 0.5
    assert stats["fp8_scale/blocks.0.qkv.weight"] == 800.0
    assert stats["fp8_amax/blocks.0.qkv.grad_output"] == pytest.approx(2e-3)
    assert stats["fp8_scale/blocks.0.qkv.grad_output"] == 2e7
    assert stats["fp8_amax/blocks.0.mlp.fc2.input"] == 3.0
    assert stats["fp8_scale/blocks.0.mlp.fc2.weight"] == 40.0
    assert stats["fp8_amax/blocks.0.mlp.fc2.grad_output"] == 6.0
    assert len(stats) == 3 * 2 * 3  # 3 GEMMs x (amax, scale) x (input, weight, grad_output)


def test_fp8_stats_rejects_bad_arguments():
    from fp8_lightning.config import ConfigError

    with pytest.raises(ConfigError, match="every_n_steps=0"):
        FP8Stats(every_n_steps=0)
    with pytest.raises(ConfigError, match="tensors=\\['output'\\]"):
        FP8Stats(tensors=["output"])
