"""Composing the configuration with Hydra: overrides checked first (an unknown key or option fails
in one line with the closest names), then composed, type-checked against the schemas and validated by
each schema's `__post_init__`."""

from __future__ import annotations

import dataclasses
import difflib

from jaxstream.config.app import CONFIG_DIR, GROUPS, AppConfig, group_options, register_schemas
from jaxstream.config.errors import ConfigError, require
from jaxstream.config.server import SECRET_SOURCES


def load_config(overrides: list[str] | tuple[str, ...] = ()) -> AppConfig:
    """Compose the config with Hydra overrides (`model=x`, `scheduler.page_size=32`) and validate it."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for override in overrides:
        _check_override(override)
    register_schemas()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=list(overrides))
        app = OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as exc:  # ValueError: Hydra's own, on odd overrides
        raise ConfigError(_describe(exc)) from None
    _reject_unknown_keys(OmegaConf.to_container(cfg), AppConfig, "")
    assert isinstance(app, AppConfig)
    return app


def _reject_unknown_keys(tree: dict, schema: type, prefix: str) -> None:
    # A backstop: overrides were checked before composing (_check_override) and Hydra refuses a group
    # file's unknown key, but a key that reaches the composed config another way would be dropped
    # silently by to_object (Hydra's `+key=value` appends even to a typed node).
    names = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in tree.items():
        require(key in names, f"{prefix}{key}", f"unknown key (not in {schema.__name__})")
        sub = GROUPS.get(key) if not prefix else None
        if sub is not None and isinstance(value, dict):
            _reject_unknown_keys(value, sub, f"{key}.")


def _check_override(text: str) -> None:
    """Refuse what Hydra would refuse less helpfully, with the closest names: a command-line flag
    (Hydra's lexer error), a key no schema has (Hydra's advice, `+key`, fails too), a group option
    with no file. Keys below a schema's field (model.hf_config.*) are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    if text.startswith("-"):
        raise ConfigError(f"{text}: not an override (key=value or group=option); "
                          "`jaxstream config [overrides...]` prints the composed config, --help lists every key")
    try:
        (override,) = OverridesParser.create().parse_overrides([text])
    except OverrideParseException as exc:
        raise ConfigError(f"{text}: not an override: {_describe(exc)}") from None
    if override.package is not None:
        raise ConfigError(f"{text}: this config places every group where it belongs; set keys as group.key=value "
                          "and choose options as group=option, without @package")
    group, _, rest = override.key_or_group.partition(".")
    if group not in GROUPS and not rest:
        raise ConfigError(f"{group}: unknown group; {_suggest(group, list(GROUPS))}")
    if group not in GROUPS:
        key = f"{group}.{rest.partition('.')[0]}"
        every_key = [f"{g}.{f.name}" for g, schema in GROUPS.items() for f in dataclasses.fields(schema)]
        raise ConfigError(f"{key}: unknown key; {_suggest(key, every_key)}")
    value = override.value()
    if not rest and isinstance(value, str) and not override.is_delete():
        options = group_options(group)
        require(value in options, f"{group}={value}",
                f"no configs/{group}/{value}.yaml; {_suggest(value, options, group + '=', most=len(options))}")
    elif rest:
        name = rest.partition(".")[0]
        where = SECRET_SOURCES.get(f"{group}.{name}")
        require(where is None, f"{group}.{name}", f"a key is never given on the command line (`ps` shows it to every user); {where}")
        names = [f.name for f in dataclasses.fields(GROUPS[group])]
        require(name in names, f"{group}.{name}", f"unknown key; {_suggest(name, names, group + '.')}")
        field = next(f for f in dataclasses.fields(GROUPS[group]) if f.name == name)
        sub, inner = rest.partition(".")[2].partition(".")[0], field.default_factory if field.default is dataclasses.MISSING else None
        if sub and inner is not None and dataclasses.is_dataclass(nested := inner()):  # a schema of its own (worker.lora)
            names = [f.name for f in dataclasses.fields(nested)]
            require(sub in names, f"{group}.{name}.{sub}", f"unknown key; {_suggest(sub, names, f'{group}.{name}.')}")


def _suggest(word: str, names: list[str], prefix: str = "", most: int = 16) -> str:
    """'did you mean <the closest names>?' (those as close as the closest, give or take), else the
    names to choose from, when they are `most` or fewer (a group's option files are listed whole: a
    user mistyping one wants to see them)."""
    scored = sorted((-difflib.SequenceMatcher(None, word, name).ratio(), name) for name in names)
    close = [name for ratio, name in scored if -ratio >= max(0.6, -scored[0][0] - 0.1)][:3] if scored else []
    if close:
        return f"did you mean {' or '.join(prefix + name for name in close)}?"
    return f"choose from {', '.join(names)}" if len(names) <= most else "--help lists every key"


def _describe(exc: BaseException) -> str:
    """Hydra's message and its cause's, without the search-path and type-dump lines."""
    noise = ("Config search path", "provider=", "reference_type=", "object_type=", "schema", "^")
    lines = []
    for part in (exc, exc.__cause__):
        if part is not None:
            lines += [ln.strip().rstrip(".:") for ln in str(part).splitlines() if ln.strip() and not ln.strip().startswith(noise)]
    return "; ".join(lines) or type(exc).__name__
