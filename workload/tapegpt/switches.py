"""The workload's environment switches (TAPEGPT_FUSED, TAPEGPT_BLAS, TAPEGPT_LAUNCH), read one way."""
import os


def env_choice(name: str, choices: dict, default: str) -> str:
    """$name, which must be one of `choices`' keys (each described by its value); `default` when unset.

    Raises:
        ValueError: any other value, naming the variable and what it may be.
    """
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected " + " or ".join(f"{k} ({v})" for k, v in choices.items()))
    return value
