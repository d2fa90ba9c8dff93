"""Frozen model configs parsed from Hugging Face ``config.json`` files (transformers 4.x and 5.x layouts).

Anything sparkjax does not implement is rejected with a :class:`~sparkjax.errors.ConfigError` naming the file
and the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
from typing import IO, Any

from .errors import ConfigError

PathLike = str | os.PathLike


def open_regular(path: PathLike, error: type[Exception] = ConfigError, what: str = "file") -> IO[bytes]:
    """Opens ``path`` for binary reading; anything but a regular file (checked with ``fstat`` on a non-blocking
    open) raises ``error`` naming it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise error(f"{path}: {what} not found") from None
    except OSError as e:
        raise error(f"{path}: cannot open {what} ({e.strerror or e})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                     (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))
            kind = next((name for test, name in kinds if test(mode)), "not a regular file")
            raise error(f"{path}: {what} is {kind}; expected a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_json(path: PathLike, error: type[Exception] = ConfigError, what: str = "file") -> dict[str, Any]:
    """Reads a JSON object from ``path`` (a regular file); any failure raises ``error`` naming the file."""
    with open_regular(path, error, what) as f:
        try:
            data = json.loads(f.read().decode("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise error(f"{path}: cannot read JSON ({e})") from None
        except RecursionError:
            raise error(f"{path}: cannot read JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclasses.dataclass
class _Fields:
    """Typed access to a config dict that reports the file and key on every problem."""

    data: dict[str, Any]
    source: str

    def _check(self, key: str, value: Any, kind: type) -> Any:
        if isinstance(value, bool) and kind is not bool:
            raise ConfigError(f"{self.source}: key '{key}' must be {_kind_name(kind)}, got {value!r}")
        if kind is float and isinstance(value, int):
            try:
                value = float(value)
            except OverflowError:
                raise ConfigError(f"{self.source}: key '{key}' is too large ({value})") from None
        if not isinstance(value, kind):
            raise ConfigError(f"{self.source}: key '{key}' must be {_kind_name(kind)}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{self.source}: key '{key}' must be a finite number, got {value!r}")
        return value

    def required(self, key: str, kind: type) -> Any:
        if key not in self.data or self.data[key] is None:
            raise ConfigError(f"{self.source}: missing required key '{key}'")
        return self._check(key, self.data[key], kind)

    def optional(self, key: str, kind: type, default: Any) -> Any:
        value = self.data.get(key)
        if value is None:
            return default
        return self._check(key, value, kind)

    def positive(self, key: str, default: int | None = None) -> int:
        value = self.required(key, int) if default is None else self.optional(key, int, default)
        if value <= 0:
            raise ConfigError(f"{self.source}: key '{key}' must be a positive integer, got {value}")
        if value >= _MAX_DIM:
            raise ConfigError(f"{self.source}: key '{key}' is {value}; sizes must be below 2**31")
        return value


# Array dimensions are int32 in XLA; a larger size cannot be a real model.
_MAX_DIM = 2**31


def _kind_name(kind: type) -> str:
    return {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}.get(kind, kind.__name__)


def _rope_theta(f: _Fields) -> float:
    """The rope base frequency; rejects any rope type other than the default one."""
    params = f.data.get("rope_parameters")
    for key in ("rope_parameters", "rope_scaling"):
        block = f.data.get(key)
        if block is not None and not isinstance(block, dict):
            raise ConfigError(f"{f.source}: key '{key}' must be an object, got {block!r}")
        if block:
            rope_type = block.get("rope_type", block.get("type", "default"))
            if rope_type != "default":
                raise ConfigError(f"{f.source}: unsupported rope scaling type {rope_type!r} in key '{key}' "
                                  "(sparkjax implements only the default rotary embedding)")
    if params and params.get("rope_theta") is not None:
        theta = _Fields(params, f"{f.source} (rope_parameters)").required("rope_theta", float)
    else:
        theta = f.optional("rope_theta", float, 10000.0)  # transformers' Qwen3Config default
    if theta <= 0:
        raise ConfigError(f"{f.source}: key 'rope_theta' must be positive, got {theta}")
    return theta


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Architecture hyper-parameters of a Qwen3 decoder (target or drafter backbone)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")

    def to_hf_dict(self) -> dict[str, Any]:
        """The fields as transformers 5.x writes them for a ``Qwen3ForCausalLM``."""
        d = dataclasses.asdict(self)
        d.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
                 rope_parameters={"rope_theta": d.pop("rope_theta"), "rope_type": "default"},
                 use_sliding_window=False, sliding_window=None,
                 layer_types=["full_attention"] * self.num_hidden_layers)
        return d

    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | PathLike, *, source: str | None = None,
                       check_architecture: bool = True) -> Qwen3Config:
        """Builds the config from a ``config.json`` path or a parsed dict (``source`` names it in errors)."""
        return cls(**qwen3_fields(_fields_of(config, source), check_architecture=check_architecture))


def _fields_of(config: dict[str, Any] | PathLike, source: str | None) -> _Fields:
    if isinstance(config, dict):
        return _Fields(config, source or "<config dict>")
    return _Fields(read_json(config), str(config))


# The ``architectures`` a target config may declare, matched exactly (not "Qwen3MoeForCausalLM").
QWEN3_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3Model")

# ``torch_dtype`` / ``dtype`` values a config may declare (the safetensors header's dtype wins).
_FLOAT_DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64", "auto")


def _check_unsupported(f: _Fields) -> None:
    """Refuses config features that would load without error but compute something else."""
    data = f.data
    quant = data.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        shown = f" (quant_method {method!r})" if method is not None else ""
        raise ConfigError(f"{f.source}: key 'quantization_config' is present{shown}; quantized checkpoints are not "
                          "supported, convert the weights to float first")
    for key in ("num_experts", "num_local_experts", "moe_intermediate_size"):
        value = data.get(key)
        if value not in (None, 0):
            raise ConfigError(f"{f.source}: key '{key}' is {value!r}; mixture-of-experts models are not implemented")
    for key in ("torch_dtype", "dtype"):
        value = data.get(key)
        if value is None:
            continue
        name = value.removeprefix("torch.") if isinstance(value, str) else None
        if name not in _FLOAT_DTYPE_NAMES:
            raise ConfigError(f"{f.source}: key '{key}' is {value!r}; model weights must be a floating-point dtype "
                              f"({', '.join(_FLOAT_DTYPE_NAMES[:3])})")


def qwen3_fields(f: _Fields, *, check_architecture: bool = True) -> dict[str, Any]:
    """Parses and validates the Qwen3 fields of a config (shared by target and drafter configs)."""
    data = f.data
    if check_architecture:
        model_type = data.get("model_type")
        if model_type is not None and model_type != "qwen3":
            raise ConfigError(f"{f.source}: key 'model_type' is {model_type!r}; sparkjax supports only 'qwen3'")
        archs = data.get("architectures")
        if archs is not None and (
            not isinstance(archs, list) or any(not isinstance(a, str) or a not in QWEN3_ARCHITECTURES for a in archs)
        ):
            raise ConfigError(
                f"{f.source}: key 'architectures' is {archs!r}; expected one of {', '.join(QWEN3_ARCHITECTURES)} "
                "(dense Qwen3; Qwen3-MoE and other families are not implemented)"
            )
    _check_unsupported(f)
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{f.source}: key 'hidden_act' is {act!r}; only 'silu' is implemented")
    if data.get("use_sliding_window"):
        raise ConfigError(f"{f.source}: key 'use_sliding_window' is true; sliding-window attention is not implemented")
    layer_types = data.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
            raise ConfigError(f"{f.source}: key 'layer_types' must be a list of strings, got {layer_types!r:.200}")
        bad = [t for t in layer_types if t != "full_attention"]
        if bad:
            raise ConfigError(
                f"{f.source}: key 'layer_types' contains {bad[0]!r}; only 'full_attention' layers are implemented"
            )
    hidden = f.positive("hidden_size")
    heads = f.positive("num_attention_heads")
    n_layers = f.positive("num_hidden_layers")
    if layer_types is not None and len(layer_types) != n_layers:
        raise ConfigError(
            f"{f.source}: key 'layer_types' has {len(layer_types)} entries but num_hidden_layers is {n_layers}"
        )
    kv_heads = f.positive("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ConfigError(f"{f.source}: key 'num_attention_heads' ({heads}) is not a multiple of "
                          f"'num_key_value_heads' ({kv_heads})")
    head_dim = f.positive("head_dim", hidden // heads)
    if head_dim % 2:
        raise ConfigError(f"{f.source}: key 'head_dim' must be even for rotary embeddings, got {head_dim}")
    eps = f.optional("rms_norm_eps", float, 1e-6)
    if eps <= 0:
        raise ConfigError(f"{f.source}: key 'rms_norm_eps' must be positive, got {eps}")
    return dict(
        vocab_size=f.positive("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.positive("intermediate_size"),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=eps,
        rope_theta=_rope_theta(f),
        max_position_embeddings=f.positive("max_position_embeddings", 32768),
        tie_word_embeddings=f.optional("tie_word_embeddings", bool, False),
        attention_bias=f.optional("attention_bias", bool, False),
    )


# ----------------------------------------------------------------------------- drafters

DRAFTER_KINDS = ("dspark", "dflash")
# refused at load time rather than as an out-of-memory failure at the first draft
MAX_BLOCK_SIZE = 1024
MARKOV_HEAD_TYPES = ("vanilla", "gated")


@dataclasses.dataclass(frozen=True)
class DrafterConfig(Qwen3Config):
    """A block drafter: the Qwen3 backbone fields plus the DSpark / DFlash fields.

    ``kind``: ``"dspark"`` (DeepSpec ``Qwen3DSparkModel``: own embedding / LM head, slot ``i`` predicts
    ``start + i + 1``, optional Markov and confidence heads) or ``"dflash"`` (z-lab ``DFlashDraftModel``: the
    target's embedding / LM head, slot ``i`` predicts ``start + i``, slot 0 unused). ``hf_json`` is the
    original ``config.json`` text (not compared), written back by :func:`sparkjax.io.hf.save_drafter`.
    """

    kind: str = "dspark"
    block_size: int = 16
    target_layer_ids: tuple[int, ...] = (1,)
    mask_token_id: int = 0
    num_target_layers: int | None = None
    num_anchors: int | None = None
    markov_rank: int = 0
    markov_head_type: str | None = None
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    # z-lab DFlash extras (identity by default)
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    hf_json: str = dataclasses.field(default="", compare=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.kind not in DRAFTER_KINDS:
            raise ConfigError(f"drafter kind must be one of {DRAFTER_KINDS}, got {self.kind!r}")
        if self.block_size < 2:
            raise ConfigError(f"key 'block_size' must be at least 2, got {self.block_size}")
        if self.block_size > min(MAX_BLOCK_SIZE, self.max_position_embeddings):
            raise ConfigError(f"key 'block_size' is {self.block_size}; it must be at most {MAX_BLOCK_SIZE} and at most "
                              f"max_position_embeddings ({self.max_position_embeddings})")
        if not self.target_layer_ids:
            raise ConfigError("key 'target_layer_ids' must not be empty")
        if self.markov_rank > 0 and self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(
                f"key 'markov_head_type' is {self.markov_head_type!r}; supported: {', '.join(MARKOV_HEAD_TYPES)}"
            )
        if self.kind == "dflash" and (self.markov_rank or self.enable_confidence_head):
            raise ConfigError("a DFlash drafter has no Markov or confidence head")

    # --- derived quantities
    @property
    def has_markov(self) -> bool:
        return self.markov_rank > 0

    @property
    def has_confidence(self) -> bool:
        return self.enable_confidence_head

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features the drafter reads (``len(ids) * hidden``)."""
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def num_drafts(self) -> int:
        """Tokens one block drafts: ``block_size`` (DSpark) or ``block_size - 1`` (DFlash)."""
        return self.block_size if self.kind == "dspark" else self.block_size - 1

    @property
    def first_draft_slot(self) -> int:
        """The block slot whose output predicts the token at ``start + 1`` (0 DSpark, 1 DFlash)."""
        return 0 if self.kind == "dspark" else 1

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` dict: the original file's keys, updated with this config's values."""
        base = {f.name: getattr(self, f.name) for f in dataclasses.fields(Qwen3Config)}
        if self.hf_json:
            d = json.loads(self.hf_json)
        else:
            d = Qwen3Config(**base).to_hf_dict()
            d["architectures"] = ["Qwen3DSparkModel" if self.kind == "dspark" else "DFlashDraftModel"]
        theta = base.pop("rope_theta")
        d.update(base)
        if "rope_parameters" in d or "rope_theta" not in d:
            d["rope_parameters"] = {**(d.get("rope_parameters") or {}), "rope_theta": theta, "rope_type": "default"}
        else:
            d["rope_theta"] = theta
        d["layer_types"] = ["full_attention"] * self.num_hidden_layers
        if self.kind == "dspark":
            d.update(block_size=self.block_size, target_layer_ids=list(self.target_layer_ids),
                     mask_token_id=self.mask_token_id, markov_rank=self.markov_rank,
                     enable_confidence_head=self.enable_confidence_head)
            optional = {"num_target_layers": self.num_target_layers, "num_anchors": self.num_anchors,
                        "markov_head_type": self.markov_head_type if self.has_markov else None,
                        "confidence_head_with_markov":
                            self.confidence_head_with_markov if self.enable_confidence_head else None}
        else:
            dc = dict(d.get("dflash_config") or {})
            dc.update(target_layer_ids=list(self.target_layer_ids), mask_token_id=self.mask_token_id)
            for key, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                                 ("final_logit_softcapping", None)):
                if getattr(self, key) != default:
                    dc[key] = getattr(self, key)
            (dc if "block_size" in dc else d)["block_size"] = self.block_size
            d["dflash_config"] = dc
            optional = {"num_target_layers": self.num_target_layers}
        d.update({k: v for k, v in optional.items() if v is not None})
        return d

    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | PathLike, *, source: str | None = None,
                       check_architecture: bool = True) -> DrafterConfig:
        """Parses a DeepSpec DSpark or z-lab DFlash ``config.json`` (path or dict); the format is detected.
        The drafter architectures are always checked (``check_architecture`` is ignored)."""
        del check_architecture
        f = _fields_of(config, source)
        src = f.source
        kind = _drafter_kind(f)
        fields = qwen3_fields(f, check_architecture=False)
        fields.update((_dspark_fields if kind == "dspark" else _dflash_fields)(f, fields))
        if f.data.get("num_target_layers") is not None:
            fields["num_target_layers"] = f.positive("num_target_layers")
        try:
            hf_json = json.dumps(f.data)
        except (TypeError, ValueError, RecursionError) as e:
            raise ConfigError(f"{src}: the config cannot be written back as JSON ({type(e).__name__}: {e})") from None
        try:
            return cls(kind=kind, hf_json=hf_json, **fields)
        except ConfigError as e:
            raise ConfigError(f"{src}: {e}") from None


def _drafter_kind(f: _Fields) -> str:
    data = f.data
    archs = data.get("architectures") or []
    if not isinstance(archs, list):
        raise ConfigError(f"{f.source}: key 'architectures' must be a list, got {archs!r}")
    names = " ".join(str(a) for a in archs)
    model_type = data.get("model_type")
    if model_type is not None and model_type != "qwen3":
        raise ConfigError(f"{f.source}: key 'model_type' is {model_type!r}; sparkjax drafters use a 'qwen3' backbone")
    if "DFlash2" in names or any(k in (data.get("dflash_config") or {}) for k in ("conv_kernel_size", "selector_rank")):
        raise ConfigError(f"{f.source}: DFlash 2 drafters (key 'architectures' {archs!r}) are not supported")
    if "dflash_config" in data or "DFlash" in names:
        if not isinstance(data.get("dflash_config"), dict):
            raise ConfigError(f"{f.source}: a z-lab DFlash config needs a 'dflash_config' object with "
                              "'target_layer_ids' and 'mask_token_id'")
        return "dflash"
    if "DSpark" in names or "markov_rank" in data or "enable_confidence_head" in data:
        return "dspark"
    raise ConfigError(f"{f.source}: cannot tell the drafter format: expected a DeepSpec DSpark config "
                      "('architectures' Qwen3DSparkModel with 'block_size', 'target_layer_ids', 'mask_token_id', "
                      "'markov_rank', ...) or a z-lab DFlash config (with a 'dflash_config' object)")


def _layer_ids(f: _Fields, key: str) -> tuple[int, ...]:
    ids = f.required(key, list)
    if not ids:
        raise ConfigError(f"{f.source}: key '{key}' must not be empty")
    for lid in ids:
        if isinstance(lid, bool) or not isinstance(lid, int) or lid < -1:
            raise ConfigError(f"{f.source}: key '{key}' must hold layer ids >= -1, got {ids!r}")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{f.source}: key '{key}' repeats a layer id: {ids!r}")
    return tuple(ids)


def _mask_id(f: _Fields, key: str, vocab: int) -> int:
    mask = f.required(key, int)
    if not 0 <= mask < vocab:
        raise ConfigError(f"{f.source}: key '{key}' is {mask}, outside the vocabulary [0, {vocab})")
    return mask


def _dspark_fields(f: _Fields, base: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = dict(
        block_size=f.positive("block_size"),
        target_layer_ids=_layer_ids(f, "target_layer_ids"),
        mask_token_id=_mask_id(f, "mask_token_id", base["vocab_size"]),
        num_anchors=f.optional("num_anchors", int, None),
    )
    rank = f.required("markov_rank", int)
    if rank < 0:
        raise ConfigError(f"{f.source}: key 'markov_rank' must be >= 0, got {rank}")
    out["markov_rank"] = rank
    if rank > 0:
        head = f.required("markov_head_type", str).lower()
        if head not in MARKOV_HEAD_TYPES:
            raise ConfigError(f"{f.source}: key 'markov_head_type' is {head!r}; sparkjax implements "
                              f"{' and '.join(repr(t) for t in MARKOV_HEAD_TYPES)}")
        out["markov_head_type"] = head
    conf = f.required("enable_confidence_head", bool)
    out["enable_confidence_head"] = conf
    if conf:
        with_markov = f.required("confidence_head_with_markov", bool)
        if with_markov and rank == 0:
            raise ConfigError(f"{f.source}: key 'confidence_head_with_markov' is true but 'markov_rank' is 0 "
                              "(no Markov head)")
        out["confidence_head_with_markov"] = with_markov
    return out


def _dflash_fields(f: _Fields, base: dict[str, Any]) -> dict[str, Any]:
    dc = _Fields(f.data["dflash_config"], f"{f.source} (dflash_config)")
    if f.data.get("is_causal"):
        raise ConfigError(f"{f.source}: key 'is_causal' is true; only bidirectional DFlash blocks are supported")
    out: dict[str, Any] = dict(
        block_size=dc.positive("block_size") if "block_size" in dc.data else f.positive("block_size", 16),
        target_layer_ids=_layer_ids(dc, "target_layer_ids"),
        mask_token_id=_mask_id(dc, "mask_token_id", base["vocab_size"]),
        input_embedding_scale=dc.optional("input_embedding_scale", float, 1.0),
        output_multiplier=dc.optional("output_multiplier", float, 1.0),
        final_logit_softcapping=dc.optional("final_logit_softcapping", float, None),
    )
    if out["final_logit_softcapping"] is not None and out["final_logit_softcapping"] <= 0:
        out["final_logit_softcapping"] = None  # upstream applies a softcap only when it is > 0
    return out
