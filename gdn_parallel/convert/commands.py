"""The conversions between our checkpoints, Hugging Face folders and consolidated torch files.

Each reads and checks everything first (config, names, shapes, what the target format can express),
then writes under a temporary name renamed at the end. Tensors are copied bit for bit; their dtype
changes only with `dtype` ('bf16', 'fp16', 'fp32'; 'keep' by default).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..checkpoint.reading import load_tensors_file
from ..config import Config, ConfigError, ModelConfig
from ..data import TokenBatches, check_vocabulary, load_dataset
from ..data.dataset import data_field
from ..data.tokenizer_record import TOKENIZER_INFO, tokenizer_files
from ..model import HybridLM, check_layers
from .atomic import check_new_output, new_directory, new_file
from .dcp_io import read_model, write_checkpoint
from .errors import ConvertError
from .hf_format import (
    CONFIG_FILE,
    EMBEDDED,
    from_hf_tensors,
    hf_config,
    read_hf_config,
    source_model_config,
    to_hf_tensors,
)
from .hf_tokenizer import (
    check_special_ids,
    describe,
    folder_tokenizer,
    read_checkpoint_tokenizer,
    require_same_tokenizer,
    write_tokenizer_files,
)
from .model_tensors import (
    EMBEDDINGS,
    KEEP,
    cast,
    check_tensors,
    drop_tied_head,
    listed,
    require_same_architecture,
)
from .safetensors_io import DEFAULT_SHARD_SIZE, is_safetensors, parse_size, read_folder, write_folder

TORCH_KEYS = ("model", "config")   # a consolidated torch file: {"model": state dict, "config": model config}


# ---------------------------------------------------------------------------- from our checkpoints
def _checkpoint_model(path) -> tuple:
    """(checkpoint, model config, model tensors, trainer state) of a checkpoint, checked against each
    other."""
    checkpoint, tensors, saved = read_model(path)
    try:
        model = Config.from_dict({"model": saved["config"]["model"]}).model
        model.validate()
        check_layers(model)
    except ConfigError as err:
        raise ConvertError(f"{checkpoint}: its config.model is not valid here: {err}") from None
    check_tensors(tensors, model, str(checkpoint))
    return checkpoint, model, tensors, saved


def to_hf(checkpoint, out_dir, dtype: str = KEEP, shard_size: str = DEFAULT_SHARD_SIZE,
          say: Callable[[str], None] | None = None) -> Path:
    """The weights, config.json and the tokenizer the checkpoint carries (hf_tokenizer.py); `say` is
    told which tokenizer the export holds."""
    check_new_output(out_dir, "OUT_DIR")
    max_bytes = parse_size(shard_size)
    source, model, tensors, _ = _checkpoint_model(checkpoint)
    tokenizer, tokenizer_json = read_checkpoint_tokenizer(source)
    check_special_ids(tokenizer, model.vocab_size, str(source))
    tensors = cast(tensors, dtype)
    config = hf_config(model, tensors[EMBEDDINGS].dtype, tokenizer)  # refuses what fla cannot express
    with new_directory(Path(out_dir)) as folder:
        write_folder(folder, to_hf_tensors(tensors), max_bytes)
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        write_tokenizer_files(folder, tokenizer, tokenizer_json)
    if say is not None:
        say(describe(tokenizer))
    return source


def to_torch(checkpoint, out_file, dtype: str = KEEP) -> Path:
    check_new_output(out_file, "FILE")
    source, model, tensors, _ = _checkpoint_model(checkpoint)
    with new_file(Path(out_file)) as temporary:
        torch.save({"model": cast(tensors, dtype), "config": dataclasses.asdict(model)}, temporary)
    return source


# ---------------------------------------------------------------------------- into our checkpoints
def target_config(source_model: ModelConfig | None, source_name: str, config_file: str | None,
                  overrides: Sequence[str] = ()) -> Config:
    """The config the new checkpoint is resumed with: --config FILE (its model must hold the same
    weights as the source's, when the source has one) or the source's model with the default
    data/train/parallel sections; --set overrides either."""
    if config_file:
        config = Config.from_yaml(config_file, list(overrides), validate=False)
        target_name = f"--config {config_file}"
    else:
        config = Config(model=dataclasses.replace(source_model))
        config = config.with_overrides(list(overrides)) if overrides else config
        target_name = "--set" if overrides else "the derived config"
    config.validate()
    check_layers(config.model, config.parallel.tp)
    if source_model is not None:
        require_same_architecture(source_model, config.model, source_name, target_name,
                                  fix="give a --config whose model matches the weights")
    return config


def data_stream_start(config: Config, dataset=None) -> dict:
    """The data stream's state at its first token (the trainer resumes it, and refuses another data
    source): the data must fit the vocabulary."""
    check_vocabulary(config.data, config.model.vocab_size)
    dataset = dataset if dataset is not None else load_dataset(config.data)
    stream = TokenBatches.from_config(config.data, config.train.seq_len, config.train.microbatch_rows,
                                      dataset=dataset)
    return stream.state_dict()


def _write_new_checkpoint(out, tensors: dict[str, torch.Tensor], source_model: ModelConfig, source_name: str,
                          config_file, overrides, dtype: str, source: dict,
                          tokenizer: dict | None = None) -> Path:
    """`tokenizer`: what made the source's ids, when it says (the new checkpoint's data must be made by
    it too); the checkpoint carries its data's tokenizer, as the trainer's do."""
    check_tensors(tensors, source_model, source_name)
    config = target_config(source_model, source_name, config_file, overrides)
    dataset = load_dataset(config.data)
    attachments = tokenizer_files(dataset)
    data_info = json.loads(attachments[TOKENIZER_INFO]) if TOKENIZER_INFO in attachments else None
    require_same_tokenizer(tokenizer, data_info, source_name, data_field(config.data))
    return write_checkpoint(Path(out), cast(tensors, dtype), config, data_stream_start(config, dataset),
                            source, attachments)


def from_hf(hf_dir, out_checkpoint, config_file: str | None = None, overrides: Sequence[str] = (),
            dtype: str = KEEP) -> Path:
    check_new_output(out_checkpoint, "OUT_CHECKPOINT")
    folder = Path(hf_dir)
    hf = read_hf_config(folder)
    where = str(folder / CONFIG_FILE)
    model = source_model_config(hf, where)
    tensors = from_hf_tensors(read_folder(folder), model, str(folder))
    return _write_new_checkpoint(out_checkpoint, tensors, model, str(folder), config_file, overrides, dtype,
                                 {"format": "hf", "path": str(folder.resolve())},
                                 folder_tokenizer(folder, hf, EMBEDDED))


def model_from_hf(hf_dir, device="cpu") -> HybridLM:
    """Our single-device model with a Hugging Face folder's weights (from its files alone), in the
    folder's dtype."""
    folder = Path(hf_dir)
    model_config = source_model_config(read_hf_config(folder), str(folder / CONFIG_FILE))
    tensors = from_hf_tensors(read_folder(folder), model_config, str(folder))
    check_tensors(tensors, model_config, str(folder))
    return _single_device_model(model_config, tensors, device)


def model_from_checkpoint(checkpoint, device="cpu") -> tuple[HybridLM, dict]:
    """Our single-device model with a checkpoint's weights (saved under any layout), in their dtype,
    and the trainer state saved with them (its "config" is the run's resolved config)."""
    _, model_config, tensors, saved = _checkpoint_model(checkpoint)
    return _single_device_model(model_config, tensors, device), saved


def _single_device_model(model_config: ModelConfig, tensors: dict[str, torch.Tensor], device) -> HybridLM:
    with torch.device("meta"):
        model = HybridLM(model_config)
    model.load_state_dict(tensors, strict=False, assign=True)  # tied: lm_head is the embedding, not a key
    if model_config.tie_word_embeddings:
        model.lm_head.weight = model.embeddings.weight
    return model.to(device)


def read_torch_file(path) -> tuple:
    """(model config, tensors) of a consolidated torch file; the model config is None for a bare
    state dict (name -> tensor), whose model the caller must take from elsewhere."""
    path = Path(path)
    if not path.is_file():
        raise ConvertError(f"{path} is not a file: give a torch file written by `gdn-convert to-torch` (or a "
                           f"state dict saved with torch.save, with --config)")
    if is_safetensors(path):
        raise ConvertError(f"{path} is a safetensors file: convert the Hugging Face folder that holds it "
                           f"(with its config.json) with from-hf")
    try:
        data = load_tensors_file(path, map_location="cpu")
    except Exception as err:  # damaged bytes end in many error types: name the file, not the unpickler
        raise ConvertError(f"{path} is not a torch file of tensors ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''})") from None
    if _is_state_dict(data):
        return None, dict(data)
    if not (isinstance(data, dict) and set(TORCH_KEYS) <= set(data) and isinstance(data["config"], dict)
            and _is_state_dict(data["model"])):
        found = (listed([repr(k) for k in sorted(data, key=str)]) if isinstance(data, dict)
                 else type(data).__name__)
        raise ConvertError(f"{path} is neither a state dict nor the to-torch form {{'model': state dict, "
                           f"'config': model config}} (found {found})")
    try:
        model = Config.from_dict({"model": data["config"]}).model
        model.validate()
        check_layers(model)
    except ConfigError as err:
        raise ConvertError(f"{path}: its config is not a valid model config: {err}") from None
    return model, dict(data["model"])


def _is_state_dict(data) -> bool:
    return isinstance(data, dict) and bool(data) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                         for k, v in data.items())


def from_torch(torch_file, out_checkpoint, config_file: str | None = None, overrides: Sequence[str] = (),
               dtype: str = KEEP) -> Path:
    check_new_output(out_checkpoint, "OUT_CHECKPOINT")
    model, tensors = read_torch_file(torch_file)
    source_name = str(torch_file)
    if model is None:  # a bare state dict: the model is --config's
        if not config_file:
            raise ConvertError(f"{torch_file} is a bare state dict ({len(tensors)} tensors) without a model "
                               f"config: give --config FILE whose model section describes it")
        model = target_config(None, "", config_file, overrides).model
        source_name = f"{torch_file} with --config {config_file}"
    tensors = drop_tied_head(tensors, model, source_name)
    return _write_new_checkpoint(out_checkpoint, tensors, model, source_name, config_file, overrides, dtype,
                                 {"format": "torch", "path": str(Path(torch_file).resolve())})
