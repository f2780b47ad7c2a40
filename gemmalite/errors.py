"""The errors gemmalite raises on bad input; all are ValueErrors with a message naming the problem."""


class ConfigError(ValueError):
    """The configuration is malformed or describes something this engine does not run."""


class CheckpointError(ValueError):
    """A checkpoint is malformed: missing file or tensor, wrong shape, unsupported config."""


class HubError(CheckpointError):
    """A Hugging Face Hub id cannot be resolved: no such repository or file, access refused (a gated or
    private repository), or the model is not cached while the Hub is unreachable or HF_HUB_OFFLINE is set."""


class ContextError(ValueError):
    """A sequence does not fit in the context the model was loaded with."""


class TokenizerError(ValueError):
    """Text was given but the checkpoint has no tokenizer, or the tokenizer files are broken."""


class ImageError(ValueError):
    """An image cannot be used: not an image, truncated or corrupt, empty or 1x1, too many pixels,
    or a mode / array layout with no RGB conversion."""


class AudioError(ValueError):
    """Audio cannot be used: not audio, truncated or corrupt, no samples, NaN / inf samples, an
    unsupported sample format or array layout, a sample rate of 0, or longer than allowed."""


class InputError(ValueError):
    """An argument of an API call has the wrong type or lies outside its range (checked before any
    work): a bad token id or option, an empty or non-string text, an unknown prompt name, a bad size."""


class NumericalError(ValueError):
    """The computation produced non-finite values (NaN / inf logits): the weights are broken."""
