"""Checkpoint conversion (`gdn-convert`, docs/design.md §4: beside train and verify, above checkpoint):
our layout-free DCP checkpoints <-> flash-linear-attention `GatedDeltaNetForCausalLM` and
`KDAForCausalLM` folders (hf_format.py, hf_kda.py, safetensors_io.py) and consolidated torch files, and
`reshard`, which loads a checkpoint under another layout and checks that every tensor landed
(reshard.py).

    __main__.py       the command line (gdn-convert)
    commands.py       to_hf, from_hf, to_torch, from_torch, model_from_hf, model_from_checkpoint
    hf_format.py      fla's names and config.json, both ways, and what it cannot express
    hf_kda.py         the same for fla's Kimi Delta Attention model (models with K layers)
    hf_tokenizer.py   the tokenizer a checkpoint carries, as an export's tokenizer and generation files
    safetensors_io.py .safetensors files and sharded folders (the safetensors library: [convert] extra)
    dcp_io.py         reading and writing our checkpoints without a process group
    model_tensors.py  names and shapes of a model config, dtype casts, architecture comparison
    reshard.py        gdn-convert reshard (under torchrun)
    atomic.py         outputs appear whole or not at all
    errors.py         ConvertError: what the user can fix (exit status 2)

docs/convert.md: the commands, the name map, what is refused, the reshard report.
"""
from .commands import from_hf, from_torch, model_from_checkpoint, model_from_hf, to_hf, to_torch
from .errors import ConvertError

__all__ = ["ConvertError", "from_hf", "from_torch", "model_from_checkpoint", "model_from_hf", "to_hf",
           "to_torch"]
