"""Which layouts to verify: every pp x dp x cp x tp whose product is the world size, plus variants.

A layout is written as comma-separated tokens (the same text the table prints and `--layouts`
reads): degrees `pp2`, `dp=2` (absent degrees are 1), and options `sp`, `allgather` / `relay`,
`zigzag` / `contiguous` (parallel.cp_attention_split), `ddp` / `fsdp`, `gathered`
(parallel.fsdp_reshard_after_forward=false), `interleaved` (virtual
stages 2; `vs=N` for more), `1f1b`, `ac=full` / `ac=selective` (activation checkpointing).
`tp2_cp2` (the old tools' names) reads the same as `tp2,cp2`.

The default set for N processes (`default_layouts`):
  * every ordered factorisation pp x dp x cp x tp = N with the default options (1F1B, FSDP2, relay,
    no sequence parallelism, no activation checkpointing): 4 for N=2, 10 for N=4, 20 for N=8;
  * each option once, on one base layout it applies to and the model accepts, chosen where the
    option's code path meets another dimension (`VARIANTS`: cp `allgather` with pp, `ddp` with pp,
    pp `interleaved` with cp, tp `sp` with cp, `ac=full` on cp with pp; then the fewest dimensions,
    then the largest degree of the option's own dimension): 5 more rows.
    N=2: pp2 dp2 cp2 tp2 + cp2,allgather dp2,ddp pp2,interleaved tp2,sp cp2,ac=full;
    N=4: 10 + pp2,cp2,allgather pp2,dp2,ddp pp2,cp2,interleaved cp2,tp2,sp pp2,cp2,ac=full;
    N=8: 20 + pp2,cp4,allgather pp2,dp4,ddp pp4,cp2,interleaved cp2,tp4,sp pp2,cp4,ac=full for a
    model that takes every layout; for the tiny config (2 GDN heads, 4 layers) tp8, pp8 and the tp4
    layouts are skipped and the variants move to pp2,cp4,interleaved and cp4,tp2,sp.
A layout the model cannot take (tp not dividing the heads, more stages than layers, a row not
divisible by cp) is listed as skipped with the reason, not run.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..config import CHECKPOINTING_MODES, ConfigError, ModelConfig, ParallelConfig
from ..model import check_layers
from ..parallel.mesh import MESH_DIMS

DIMS = MESH_DIMS                            # the mesh order, outermost first
INTERLEAVED_VIRTUAL_STAGES = 2


class LayoutError(ValueError):
    """A `--layouts` entry that cannot be read or does not fit the job; the message says what to write."""


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    cp_algorithm: str = "relay"
    cp_attention_split: str = "contiguous"
    data_parallel: str = "fsdp"
    fsdp_reshard_after_forward: bool = True   # `gathered`: FSDP2 keeps a step's gathered parameters
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    activation_checkpointing: str = "none"
    activation_offload: str = "none"   # cpu: full checkpointing's block inputs in host memory

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def name(self) -> str:
        """Degrees above 1 (all of them, as `pp1,dp1,cp1,tp1`, on one process), then the options
        that differ from the defaults; `parse_layout(name)` gives the layout back."""
        parts = [f"{d}{getattr(self, d)}" for d in DIMS if getattr(self, d) > 1] or \
            [f"{d}1" for d in DIMS]
        if self.sequence_parallel:
            parts.append("sp")
        if self.cp_algorithm != "relay":
            parts.append(self.cp_algorithm)
        if self.cp_attention_split != "contiguous":
            parts.append(self.cp_attention_split)
        if self.data_parallel != "fsdp":
            parts.append(self.data_parallel)
        if not self.fsdp_reshard_after_forward:
            parts.append("gathered")
        if self.pp_schedule != "1f1b":
            parts.append(self.pp_schedule)
            if self.virtual_stages != INTERLEAVED_VIRTUAL_STAGES:
                parts.append(f"vs={self.virtual_stages}")
        if self.activation_checkpointing != "none":
            parts.append(f"ac={self.activation_checkpointing}")
        if self.activation_offload != "none":
            parts.append("offload")
        return ",".join(parts)

    def parallel_kwargs(self) -> dict:
        """The `parallel` config fields of the layout (activation checkpointing and offload are train
        fields)."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k not in ("activation_checkpointing", "activation_offload")}

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(**self.parallel_kwargs())

    def as_dict(self) -> dict:
        return {"name": self.name, **dataclasses.asdict(self)}


# ------------------------------------------------------------------------------------ reading
_OPTION_WORDS = {
    "sp": ("sequence_parallel", True), "sequence_parallel": ("sequence_parallel", True),
    "relay": ("cp_algorithm", "relay"), "allgather": ("cp_algorithm", "allgather"),
    "contiguous": ("cp_attention_split", "contiguous"), "zigzag": ("cp_attention_split", "zigzag"),
    "fsdp": ("data_parallel", "fsdp"), "ddp": ("data_parallel", "ddp"),
    "gathered": ("fsdp_reshard_after_forward", False),
    "1f1b": ("pp_schedule", "1f1b"), "interleaved": ("pp_schedule", "interleaved"),
    "offload": ("activation_offload", "cpu"),
}
_KEYED = {"cp_algorithm": "cp_algorithm", "cp_attention_split": "cp_attention_split",
          "data_parallel": "data_parallel", "pp_schedule": "pp_schedule",
          "vs": "virtual_stages", "virtual_stages": "virtual_stages",
          "ac": "activation_checkpointing", "activation_checkpointing": "activation_checkpointing"}
_DEGREE = re.compile(r"(pp|dp|cp|tp)=?(\d+)")
ACCEPTED = ("degrees pp2 / pp=2 (also dp, cp, tp), sp, relay, allgather, contiguous, zigzag, fsdp, ddp, "
            "gathered (FSDP2 parameters gathered once a step), 1f1b, interleaved, "
            "vs=N, ac=none|selective|full, offload (with ac=full)")


def parse_layout(spec: str) -> Layout:
    """One layout from its text, e.g. `tp2,cp2`, `pp=2,dp=2,ddp`, `cp4,allgather,ac=full`."""
    fields: dict = {}
    tokens = []
    for chunk in re.split(r"[,\s]+", spec.strip().lower()):
        # `_` joins the old tools' names (tp2_cp2), but is part of `cp_algorithm=...`, `sequence_parallel`
        tokens.extend([chunk] if "=" in chunk or chunk in _OPTION_WORDS else chunk.split("_"))
    tokens = [t for t in tokens if t]
    if not tokens:
        raise LayoutError(f"empty layout {spec!r}: write its degrees, e.g. tp2,cp2")
    for token in tokens:
        degree = _DEGREE.fullmatch(token)
        if degree:
            key, value = degree.group(1), int(degree.group(2))
            if value < 1:
                raise LayoutError(f"layout {spec!r}: {token} must be at least 1")
        elif token in _OPTION_WORDS:
            key, value = _OPTION_WORDS[token]
        elif "=" in token and token.split("=", 1)[0] in _KEYED:
            name, text = token.split("=", 1)
            key = _KEYED[name]
            value = int(text) if key == "virtual_stages" and text.isdigit() else text
        else:
            raise LayoutError(f"layout {spec!r}: cannot read {token!r}; accepted: {ACCEPTED}")
        if key in fields and fields[key] != value:
            raise LayoutError(f"layout {spec!r} sets {key} twice ({fields[key]!r} and {value!r})")
        fields[key] = value
    if fields.get("pp_schedule") == "interleaved":
        fields.setdefault("virtual_stages", INTERLEAVED_VIRTUAL_STAGES)
    if fields.get("activation_checkpointing", "none") not in CHECKPOINTING_MODES:
        raise LayoutError(f"layout {spec!r}: ac={fields['activation_checkpointing']} is not one of "
                          f"{', '.join(CHECKPOINTING_MODES)}")
    offloads = fields.get("activation_offload", "none") != "none"
    if offloads and fields.get("activation_checkpointing") != "full":
        raise LayoutError(f"layout {spec!r}: offload holds the block inputs full checkpointing keeps; "
                          f"add ac=full")
    layout = Layout(**fields)
    try:
        layout.parallel_config().validate()
    except ConfigError as err:
        raise LayoutError(f"layout {spec!r}: {err}") from None
    return layout


def parse_layouts(specs: Iterable[str], world_size: int) -> list[Layout]:
    """`--layouts` values: each one layout, or several separated by ';' or spaces between layouts."""
    layouts = []
    for spec in specs:
        for item in (s for s in re.split(r"[;\s]+", spec) if s):
            layout = parse_layout(item)
            if layout.world_size != world_size:
                raise LayoutError(
                    f"layout {item!r} uses pp*dp*cp*tp = {layout.world_size} processes but the job has "
                    f"{world_size}: give degrees whose product is {world_size} (e.g. "
                    f"{_example(world_size, layout)}) or start {layout.world_size} processes")
            layouts.append(layout)
    if not layouts:
        raise LayoutError("--layouts was given without a layout: write e.g. --layouts tp2,cp2")
    return list(dict.fromkeys(layouts))


def _example(world_size: int, layout: Layout) -> str:
    missing = world_size // layout.world_size if world_size % layout.world_size == 0 else 0
    if missing > 1:
        return Layout(**{**dataclasses.asdict(layout), "dp": layout.dp * missing}).name
    return ",".join(f"{d}{v}" for d, v in zip(DIMS, factorisations(world_size)[-1]) if v > 1) or "dp1"


# ------------------------------------------------------------------------------------ enumerating
def factorisations(n: int) -> list[tuple[int, int, int, int]]:
    """Every (pp, dp, cp, tp) of positive integers with product n, in lexicographic order."""
    if n < 1:
        raise ValueError(f"a world of {n} processes")
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return [(pp, dp, cp, n // (pp * dp * cp))
            for pp in divisors for dp in divisors for cp in divisors
            if n % (pp * dp * cp) == 0]


def base_layouts(world_size: int) -> list[Layout]:
    """The factorisations of the world with default options, single dimensions first (pure tp, pp,
    dp, cp), then by the number of dimensions used: the simplest failing row is the most telling."""
    layouts = [Layout(*f) for f in factorisations(world_size)]
    return sorted(layouts, key=lambda l: (sum(getattr(l, d) > 1 for d in DIMS),
                                          [-getattr(l, d) for d in ("tp", "pp", "dp", "cp")]))


# (option fields, the degree it needs above 1, the other dimensions it is best checked with, in
# order of preference: where the option's own code path meets another dimension's)
VARIANTS = (
    # the all-gather is a lockstep collective per layer: under a pipeline schedule every stage's
    # CP group must still call it in the same order
    ({"cp_algorithm": "allgather"}, "cp", ("pp", "dp", "tp")),
    # DDP with a pipeline has no wrapper: the stage gradients are all-reduced by hand (parallelize.py)
    ({"data_parallel": "ddp"}, "dp", ("pp", "cp", "tp")),
    ({"pp_schedule": "interleaved", "virtual_stages": INTERLEAVED_VIRTUAL_STAGES}, "pp", ("cp", "dp", "tp")),
    # sequence parallelism splits each CP shard again over tp
    ({"sequence_parallel": True}, "tp", ("cp", "dp", "pp")),
    # recomputed blocks replay their CP messages (comm/replay.py), here inside pipeline stages
    ({"activation_checkpointing": "full"}, "cp", ("pp", "dp", "tp")),
    # offloaded block inputs under FSDP2's hooks and pipeline stages
    ({"activation_checkpointing": "full", "activation_offload": "cpu"}, "dp", ("pp", "cp", "tp")),
)


def default_layouts(world_size: int, model: ModelConfig,
                    tokens_per_row: int) -> list[tuple[Layout, str | None]]:
    """(layout, reason it is skipped or None) for the default set (module docstring)."""
    bases = base_layouts(world_size)
    result = [(layout, unsupported_reason(layout, model, tokens_per_row)) for layout in bases]
    for fields, needs, partners in VARIANTS:
        def preference(base: Layout, partners: tuple = partners, needs: str = needs):
            present = [i for i, d in enumerate(partners) if getattr(base, d) > 1]
            dims_used = sum(getattr(base, d) > 1 for d in DIMS)
            return (present[0] if present else len(partners), dims_used, -getattr(base, needs))
        for base in sorted((b for b in bases if getattr(b, needs) > 1), key=preference):
            variant = dataclasses.replace(base, **fields)
            if unsupported_reason(variant, model, tokens_per_row) is None:
                result.append((variant, None))
                break
    return result


def unsupported_reason(layout: Layout, model: ModelConfig, tokens_per_row: int) -> str | None:
    """Why the model (or the verification row) cannot run under `layout`, or None."""
    config = layout.parallel_config()
    try:
        config.validate(model)
        check_layers(model, config.tp, config.cp)
    except ConfigError as err:
        return str(err)
    split = layout.cp * (layout.tp if layout.sequence_parallel else 1)
    if tokens_per_row % split:
        split_by = "cp * tp" if layout.sequence_parallel else "cp"
        return (f"a row of {tokens_per_row} tokens does not split into {split_by} = {split} equal shards; "
                f"change --seq-len or --rows")
    if layout.cp_attention_split == "zigzag" and layout.cp > 1 and tokens_per_row % (2 * layout.cp):
        return (f"zigzag attention cuts a row into 2 x cp = {2 * layout.cp} equal query blocks, and a row of "
                f"{tokens_per_row} tokens does not divide by {2 * layout.cp}; change --seq-len or --rows")
    return None


def describe_default_set(world_size: int, model: ModelConfig, tokens_per_row: int) -> str:
    return "; ".join(l.name + (" (skipped)" if r else "")
                     for l, r in default_layouts(world_size, model, tokens_per_row))


def layouts_to_run(specs: Sequence[str] | None, world_size: int, model: ModelConfig,
                   tokens_per_row: int) -> list[tuple[Layout, str | None]]:
    """The layouts of the job: the default set, or the `--layouts` ones (which must all run); the word
    `default` among them stands for the default set (its skips listed as usual), e.g. `--layouts
    default cp2,zigzag`."""
    if not specs:
        return default_layouts(world_size, model, tokens_per_row)
    words = [item for spec in specs for item in re.split(r"[;\s]+", spec) if item]
    if not words:
        parse_layouts(specs, world_size)        # says that --layouts came without a layout
    chosen = default_layouts(world_size, model, tokens_per_row) if "default" in words else []
    named = [word for word in words if word != "default"]
    for layout in parse_layouts(named, world_size) if named else []:
        if any(layout == known for known, _ in chosen):
            continue
        reason = unsupported_reason(layout, model, tokens_per_row)
        if reason is not None:
            raise LayoutError(f"layout {layout.name}: {reason}")
        chosen.append((layout, None))
    return chosen
