"""`servelm serve --config FILE.yaml` and `servelm config show`: serve options from a file.

Owns: the config keys (every serve flag's long name, with dashes or underscores; the
topology flags, TopologyConfig's and the engine's model-parallel ones, under one `topology:`
section and only there), reading a file into typed values through the flags' own argparse
types and choices (so a bad value gets the flag's error, naming the key and the file), the
precedence (command line over file over default) and the effective configuration printed
as YAML.
Never: defines an option (a new serve flag is a new key, a new TopologyConfig field a new
topology key, with no edit here), starts a process or loads a model. Replicas get the
parsed options as JSON (--options-from-stdin), so only the parent reads the file.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any, NamedTuple

# The engine's flags that choose its processes and their layout (model-parallel ranks,
# the prefill/decode role: EngineArgs fields, config/engine.py).
ENGINE_TOPOLOGY_KEYS = ("tensor-parallel-size", "pipeline-parallel-size",
                        "enable-expert-parallel", "parallel-master", "parallel-launcher",
                        "parallel-placement", "role")


def _topology_keys() -> tuple[str, ...]:
    from servelm.config.flags import flag_fields, flag_names
    from servelm.serve.topology import TopologyConfig

    return tuple(flag_names(field, flag)[0][2:] for field, flag in flag_fields(TopologyConfig))


# The flags that choose the processes and their layout (TopologyConfig's: data-parallel
# replicas, Ray replicas, disaggregation, where the engine core runs; and the engine's): in
# a file they live under `topology:` and nowhere else, so a file says each thing one way.
TOPOLOGY_KEYS = _topology_keys() + ENGINE_TOPOLOGY_KEYS
TOPOLOGY = "topology"
SOURCES = ("default", "file", "command line")
# Flags that are no config key: the file itself, and the replicas' hidden channel.
_NOT_KEYS = ("config", "options_from_stdin", "help")


class ConfigFileError(ValueError):
    """A config file that cannot be used; the message names the file and the key."""


class Option(NamedTuple):
    key: str  # canonical: the flag's first long name without dashes (`model` for the positional)
    action: argparse.Action
    is_topology: bool


class Resolved(NamedTuple):
    args: argparse.Namespace  # the effective serve options, as `servelm serve` parses them
    sources: dict[str, str]  # dest -> one of SOURCES


def serve_parser(prog: str = "servelm serve") -> argparse.ArgumentParser:
    from servelm.serve.cli import add_serve_args

    parser = argparse.ArgumentParser(prog=prog)
    add_serve_args(parser)
    return parser


def serve_options(parser: argparse.ArgumentParser) -> dict[str, Option]:
    """Every accepted key (dashed form) -> its Option, in the parser's order; aliases and
    the --no- half of a --x/--no-x pair are keys of the same flag."""
    options: dict[str, Option] = {}
    for action in parser._actions:  # argparse has no public list of a parser's flags
        if action.dest in _NOT_KEYS or action.help == argparse.SUPPRESS:
            continue
        names = [s[2:] for s in action.option_strings if s.startswith("--")]
        names = names or [action.dest.replace("_", "-")]
        option = Option(names[0], action, names[0] in TOPOLOGY_KEYS)
        for name in names:
            options[name] = option
    return options


def _normal(key: Any) -> str:
    return str(key).replace("_", "-")


def _typed(parser, option: Option, name: str, value: Any) -> Any:
    """The value a flag would get from the command line, for the file's `value`."""
    action = option.action
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        if not isinstance(value, bool):
            raise argparse.ArgumentError(None, f"expected true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return value != name.startswith("no-")
        return action.const if value else not action.const
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [_one(parser, action, item) for item in items]
    return _one(parser, action, value)


def _one(parser, action: argparse.Action, value: Any) -> Any:
    if isinstance(value, (list, dict)):
        raise argparse.ArgumentError(None, f"expected one value, got {value!r}")
    if isinstance(value, bool):  # YAML's true/false, as the command line would spell them
        value = str(value).lower()
    result = parser._get_value(action, str(value))  # the flag's own type and its error
    parser._check_value(action, result)  # and its choices
    return result


def _entries(data: dict, path: str):
    """(name, value, is_under_topology) for each key of the file, refusing misplaced keys."""
    for key, value in data.items():
        if _normal(key) == TOPOLOGY:
            if not isinstance(value, dict):
                raise ConfigFileError(f"{path}: {TOPOLOGY}: expected a mapping of "
                                      f"topology options, got {value!r}")
            yield from ((_normal(k), v, True) for k, v in value.items())
        else:
            yield _normal(key), value, False


def load_file(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The file's options: dest -> typed value (a null value is left to the default)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigFileError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: expected a mapping of serve options at the top")
    options, values, seen = serve_options(parser), {}, {}
    for name, value, under_topology in _entries(data, path):
        option = options.get(name)
        if option is None:
            raise ConfigFileError(f"{path}: {name}: unknown key" + _suggest(name, options))
        if option.is_topology != under_topology:
            kind, where = (("topology", f"under `{TOPOLOGY}:`") if option.is_topology
                           else ("serve", "at the top level"))
            raise ConfigFileError(f"{path}: {name}: a {kind} option, which belongs {where}")
        dest = option.action.dest
        if dest in seen:
            raise ConfigFileError(f"{path}: {name}: the same option as {seen[dest]}")
        seen[dest] = name
        if value is None:
            continue
        try:
            values[dest] = _typed(parser, option, name, value)
        except argparse.ArgumentError as exc:
            raise ConfigFileError(f"{path}: {name}: {exc.message}") from None
    return values


def _suggest(name: str, options: dict[str, Option]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def given_dests(argv: list[str]) -> set[str]:
    """The dests `argv` (serve's arguments) sets itself, whatever their values."""
    parser = serve_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def resolve(args: argparse.Namespace, argv: list[str]) -> Resolved:
    """`args` (serve's options parsed from `argv`) with args.config's options laid under the
    flags `argv` gives, and where each value came from."""
    parser = serve_parser()
    from_file = load_file(args.config, parser) if args.config else {}
    given = given_dests(argv)
    sources = {}
    for option in serve_options(parser).values():
        dest = option.action.dest
        if dest in given:
            sources[dest] = "command line"
        elif dest in from_file:
            setattr(args, dest, from_file[dest])
            sources[dest] = "file"
        else:
            sources[dest] = "default"
    return Resolved(args, sources)


def file_flags(args: argparse.Namespace) -> list[str]:
    """The flags args.config sets, spelled as on a command line (`--parallel-launcher`), for
    code that asks whether a flag was given at all (the Ray backend's replica shape)."""
    if not getattr(args, "config", None):
        return []
    parser = serve_parser()
    keys = {o.action.dest: o.key for o in serve_options(parser).values()}
    return [f"--{keys[dest]}" for dest in load_file(args.config, parser)]


def _arguments_after(argv: list[str], words: tuple[str, ...]) -> list[str]:
    """argv past its command words (`serve`, or `config show`)."""
    rest = list(argv)
    for word in words:
        rest = rest[rest.index(word) + 1:]
    return rest


def with_config_file(args: argparse.Namespace, argv: list[str]) -> argparse.Namespace:
    """The hook of `servelm` (servelm/cli.py) after parsing: serve's --config applied, or for
    `config show` the sources recorded; a file that cannot be used exits as argparse does."""
    words = ("serve",) if args.command == "serve" else ("config", "show")
    if args.command == "serve" and args.config is None:
        return args
    try:
        serve_argv = [a for a in _arguments_after(argv, words) if a != "--show-secrets"]
        resolved = resolve(args, serve_argv)
    except ConfigFileError as exc:
        serve_parser(prog="servelm " + " ".join(words)).error(str(exc))
    if args.command == "config":  # never forwarded to replicas, so it may carry more
        args.option_sources = resolved.sources
    return resolved.args


# options whose values are credentials: `config show` prints them only when asked, since its
# output is meant to be pasted into issues and logs
SECRET_OPTIONS = frozenset({"api_key"})


def to_yaml(args: argparse.Namespace, sources: dict[str, str],
            show_secrets: bool = False) -> str:
    """The effective options as a config file (feeding it back gives the same options, but
    for a credential that is set, which is hidden unless `show_secrets`), each value followed
    by its source."""
    import yaml

    top, topology = [], []
    seen = set()
    for option in serve_options(serve_parser()).values():
        dest = option.action.dest
        if dest in seen:
            continue
        seen.add(dest)
        value = _yaml_value(option, getattr(args, dest))
        source = sources.get(dest, "default")
        if dest in SECRET_OPTIONS and value is not None and not show_secrets:
            value, source = None, f"{source}; set, hidden (--show-secrets prints it)"
        text = yaml.safe_dump({option.key: value}, default_flow_style=True, width=10**6)
        line = f"{text.strip()[1:-1]}  # {source}"
        (topology if option.is_topology else top).append(line)
    head = ["# servelm serve: the effective configuration (servelm config show);",
            "# each value's source follows it: default, file or command line"]
    return "\n".join(head + top + [f"{TOPOLOGY}:"] + [f"  {t}" for t in topology]) + "\n"


def _yaml_value(option: Option, value: Any) -> Any:
    action = option.action
    if isinstance(action, argparse.BooleanOptionalAction):
        return bool(value)
    if action.nargs == 0:  # the key's true means the flag is given: its const
        return value == action.const
    if isinstance(value, tuple):  # a comma list parsed by the flag's type
        return ",".join(map(str, value))
    return value


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("config", help="the serve configuration: `config show`")
    sub = p.add_subparsers(dest="config_command", required=True)
    show = sub.add_parser("show", help="print the effective serve options as YAML",
                          description="Print the options `servelm serve` would run with "
                                      "(its flags and --config), each with its source, as a "
                                      "config file; starts nothing.")
    from servelm.serve.cli import add_serve_args

    add_serve_args(show)
    show.add_argument("--show-secrets", action="store_true",
                      help="print credentials (--api-key) instead of hiding them")
    show.set_defaults(func=show_handler)


def show_handler(args) -> int:
    print(to_yaml(args, args.option_sources, args.show_secrets), end="")
    return 0
