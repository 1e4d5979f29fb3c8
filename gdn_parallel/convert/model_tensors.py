"""What a HybridLM of a given config holds (names and shapes), checks of converted tensors against it,
dtype casts, and the refusal of two configs whose architectures differ (the rule is the model's:
model/architecture.py)."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..model import HybridLM, architecture_differences
from .errors import ConvertError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KEEP = "keep"
EMBEDDINGS, LM_HEAD = "embeddings.weight", "lm_head.weight"   # our names (fla's: under `model.`, and lm_head)


def expected_shapes(model_config: ModelConfig) -> dict[str, torch.Size]:
    """name -> shape of every parameter of the single-device model (a tied lm_head is the embedding)."""
    with torch.device("meta"):
        model = HybridLM(model_config)
    return {name: param.shape for name, param in model.named_parameters()}


def drop_tied_head(tensors: dict[str, torch.Tensor], model_config: ModelConfig,
                   source: str) -> dict[str, torch.Tensor]:
    """Our names without a tied lm_head: some writers (a module's state_dict, save_pretrained of some
    models) store it beside the embedding it is; it must be that embedding."""
    if not model_config.tie_word_embeddings or LM_HEAD not in tensors:
        return tensors
    tensors = dict(tensors)
    head, embeddings = tensors.pop(LM_HEAD), tensors.get(EMBEDDINGS)
    if embeddings is None or not torch.equal(head, embeddings):
        raise ConvertError(f"{source}: the config says tie_word_embeddings=true but its {LM_HEAD} is not its "
                           f"embedding matrix; set tie_word_embeddings=false in the config if the head is "
                           f"its own")
    return tensors


def check_tensors(tensors: dict[str, torch.Tensor], model_config: ModelConfig, source: str) -> None:
    """Every parameter present with its shape, nothing else; the message names what differs."""
    expected = expected_shapes(model_config)
    embeddings = tensors.get(EMBEDDINGS)
    if embeddings is not None and embeddings.dim() == 2 and embeddings.shape[0] != model_config.vocab_size:
        raise ConvertError(f"vocabulary mismatch: {source} has embeddings for {embeddings.shape[0]} tokens "
                           f"but its config says vocab_size={model_config.vocab_size}; the weights and the "
                           f"config are of different models")
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [f"{name}: {tuple(tensors[name].shape)}, expected {tuple(shape)}"
             for name, shape in expected.items() if name in tensors and tensors[name].shape != shape]
    problems = []
    if missing:
        problems.append(f"missing {listed(missing)}")
    if unexpected:
        problems.append(f"not in the model {listed(unexpected)}")
    if wrong:
        problems.append(f"shapes differ: {listed(wrong)}")
    if problems:
        raise ConvertError(f"{source} does not hold the weights of the model its config describes: "
                           f"{'; '.join(problems)}")


def listed(items, limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return f"[{shown}{f', ... ({len(items)} in all)' if len(items) > limit else ''}]"


def cast(tensors: dict[str, torch.Tensor], dtype_name: str) -> dict[str, torch.Tensor]:
    """Floating tensors to DTYPES[dtype_name]; 'keep' leaves every tensor as it is."""
    if dtype_name == KEEP:
        return dict(tensors)
    dtype = DTYPES[dtype_name]
    return {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}


def require_same_architecture(source: ModelConfig, target: ModelConfig, source_name: str,
                              target_name: str, fix: str | None = None, where: str = "") -> None:
    differing = architecture_differences(source, target)
    if differing:
        details = "; ".join(f"{key}: {source_name} {a!r}, {target_name} {b!r}"
                            for key, (a, b) in differing.items())
        raise ConvertError((f"{where}: " if where else "") + f"model config mismatch between {source_name} "
                           f"and {target_name}: {details}" + (f"; {fix}" if fix else ""))
