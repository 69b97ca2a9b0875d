"""A fleet: the hosts of one service and how to reach each, as one value.

From `--hosts a,b,c` (each `[user@]host[:port]`, node ranks in order) or a TOML fleet file:

    ssh_config = "~/.ssh/config"           # passed as `ssh -F` (optional)
    ssh_options = ["ConnectTimeout=5"]     # each passed as `ssh -o` (optional)
    registry = "registry.local:5000/dsv4"  # where `pull` takes kernel-cache entries from (optional)
    insecure = false                       # that registry speaks plain HTTP

    [launch]                               # the launch flags every host shares (dsv4 serve's)
    model = "/models/DeepSeek-V4-Flash"
    backend = "aoti"
    ranks = 16                             # the service's ranks on all hosts together

    [[hosts]]
    name = "gpu-a"                         # what the console calls it (and ssh's destination)
    address = "10.0.0.1"                   # ssh's destination, if not the name
    node_rank = 0                          # default: its place in the list
    user = "serve"
    port = 22
    ssh_options = ["IdentityFile=~/.ssh/fleet"]
    dsv4 = "/opt/dsv4/.venv/bin/dsv4"      # default: `dsv4` on that host's PATH
    master_addr = "10.0.0.1"               # how the other hosts reach it as node 0 (default: the
                                           # address ssh reached it at)

Every mistake is one line naming the file and the key.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from runtime.launch.spec import CONSOLE, FLAGS_BY_FIELD, LaunchSpec, parse
from store.errors import UserError

_OPTION = re.compile(r"^[A-Za-z][A-Za-z0-9]*=.*$")
_NAME = re.compile(r"^[A-Za-z0-9_.:@%+-]+$")  # what a host name or ssh destination may be (never `-o…`)
MAX_HOSTS = 1024


@dataclass(frozen=True)
class FleetHost:
    name: str
    node_rank: int
    address: str = ""  # ssh's destination (default: name)
    user: str | None = None
    port: int | None = None
    ssh_options: tuple[str, ...] = ()
    dsv4: str = "dsv4"
    master_addr: str = ""

    @property
    def destination(self) -> str:
        return self.address or self.name

    @property
    def rendezvous(self) -> str:
        """The address the other hosts reach this one at, as node 0 (`auto`: the address our ssh
        session reached it at, which node 0 reads and reports)."""
        return self.master_addr or "auto"


@dataclass(frozen=True)
class Fleet:
    hosts: tuple[FleetHost, ...]
    launch: tuple[str, ...] = ()  # launch flags (dsv4-console's / dsv4 serve's), as argv
    ssh_config: str | None = None
    ssh_options: tuple[str, ...] = ()
    source: str = "--hosts"  # where it was read from (for messages)
    registry: str = ""  # where `pull` takes kernel-cache entries from (HOST/REPO)
    insecure: bool = False  # that registry speaks plain HTTP

    def host(self, name: str) -> FleetHost:
        return next(h for h in self.hosts if h.name == name)

    def spec(self, console: LaunchSpec | None = None) -> LaunchSpec:
        """The launch every host shares: the fleet file's [launch] flags, then the console's own
        command line over them. `ranks` is the service's, all hosts together (default: one per
        host; a launch across the hosts needs a multiple of them)."""
        argv = [*self.launch, *(console.argv(CONSOLE) if console is not None else [])]
        spec = remote_spec(argv)
        return spec.with_(ranks=len(self.hosts)) if "--ranks" not in argv and len(self.hosts) > 1 else spec

    def split(self, spec: LaunchSpec, hosts: int | None = None) -> str:
        """Why `spec`'s ranks cannot be launched over `hosts` of these hosts (default: all of
        them; "" when they can)."""
        n = hosts or len(self.hosts)
        if spec.ranks % n:
            return f"--ranks {spec.ranks} does not split over {n} hosts; give a multiple of {n}"
        return ""

    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def checked_out(self, names) -> frozenset[str]:
        """`--exclude` names, each a host of this fleet, at least one host left in."""
        out = frozenset(names)
        if unknown := sorted(out - set(self.names())):
            raise UserError(f"--exclude {unknown[0]}: not a host of {self.source} ({', '.join(self.names())})")
        if len(out) >= len(self.hosts):
            raise UserError("--exclude leaves no host: a service needs one at least")
        return out

    def service(self, spec: LaunchSpec, left_out=frozenset()) -> LaunchSpec:
        """The launch over the hosts not left out: each keeps its share of the ranks (`spec`'s
        ranks are the whole fleet's), so leaving one out takes its ranks with it."""
        active = len(self.hosts) - len(set(left_out) & set(self.names()))
        if not left_out or spec.ranks % len(self.hosts):
            return spec
        return spec.with_(ranks=spec.ranks // len(self.hosts) * active)


def remote_spec(argv: list[str]) -> LaunchSpec:
    """The launch flags' spec, its `--model` a path on the hosts (never looked for here)."""
    model = None
    rest = list(argv)
    while "--model" in rest:
        i = rest.index("--model")
        model, rest = (rest[i + 1] if i + 1 < len(rest) else None), rest[:i] + rest[i + 2:]
    spec = parse(rest, CONSOLE)
    return spec.with_(model=Path(model)) if model else spec


def _options(where: str, raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, dict):
        raw = [f"{k}={v}" for k, v in raw.items()]
    if not isinstance(raw, list) or not all(isinstance(o, str) and _OPTION.match(o) for o in raw):
        raise UserError(f"{where}: ssh options are KEY=VALUE strings (as `ssh -o` takes them)")
    return tuple(raw)


def check_options(options: list[str] | tuple[str, ...], where: str = "--ssh-option") -> tuple[str, ...]:
    return _options(where, list(options))


def _host_word(where: str, value: Any) -> str:
    if not isinstance(value, str) or not _NAME.match(value) or value.startswith("-"):
        raise UserError(f"{where}: {value!r} is not a host name or address")
    return value


def from_hosts(text: str) -> Fleet:
    """`--hosts a,b,user@c:2222`: node ranks in order."""
    hosts = []
    for i, word in enumerate(w.strip() for w in text.split(",")):
        if not word:
            raise UserError(f"--hosts {text!r}: an empty host name")
        user, _, rest = word.rpartition("@")
        name, port = rest, None
        if rest.count(":") == 1:  # host:port (an IPv6 address has more colons)
            name, _, p = rest.partition(":")
            if not p.isdigit() or not 1 <= int(p) <= 65535:
                raise UserError(f"--hosts: {word!r}: the port must be 1..65535")
            port = int(p)
        hosts.append(FleetHost(_host_word("--hosts", name), i, user=user or None, port=port))
    return _checked(Fleet(tuple(hosts)))


def _launch_argv(where: str, table: Any) -> tuple[str, ...]:
    """The [launch] table as launch flags (`backend = "aoti"` → `--backend aoti`), checked by the
    launch spec's own parser."""
    if not isinstance(table, dict):
        raise UserError(f"{where}: [launch] must be a table of launch settings")
    argv: list[str] = []
    for key, value in table.items():
        flag = FLAGS_BY_FIELD.get(key.replace("-", "_"))
        if flag is None or CONSOLE not in flag.commands:
            raise UserError(f"{where}: [launch] {key}: not a launch setting (see `dsv4 serve --help`)")
        if flag.field == "model":
            argv += ["--model", str(value)]
        elif flag.negate:
            if value is not False and value is not True:
                raise UserError(f"{where}: [launch] {key}: true or false")
            argv += [] if value else [flag.flag]
        else:
            argv += [flag.flag, str(value)]
    try:
        remote_spec(argv)
    except SystemExit:  # argparse's own refusal (a choice or type it printed)
        raise UserError(f"{where}: [launch] has a value `dsv4 serve` refuses (see above)") from None
    except UserError as e:
        raise UserError(f"{where}: [launch]: {e}") from None
    return tuple(argv)


TOP_KEYS = {"hosts", "launch", "ssh_config", "ssh_options", "registry", "insecure"}
HOST_KEYS = {"name", "address", "node_rank", "user", "port", "ssh_options", "dsv4", "master_addr"}


def load(path: Path) -> Fleet:
    """A fleet file (TOML; see the module docstring)."""
    where = str(path)
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise UserError(f"--fleet {where}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"--fleet {where}: not TOML ({e})") from None
    unknown = set(raw) - TOP_KEYS
    if unknown:
        raise UserError(f"{where}: unknown key {sorted(unknown)[0]!r} ({', '.join(sorted(TOP_KEYS))})")
    rows = raw.get("hosts")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise UserError(f"{where}: no hosts: add [[hosts]] tables with a name each")
    hosts = []
    for i, row in enumerate(rows):
        at = f"{where}: hosts[{i}]"
        if bad := set(row) - HOST_KEYS:
            raise UserError(f"{at}: unknown key {sorted(bad)[0]!r} ({', '.join(sorted(HOST_KEYS))})")
        name = _host_word(f"{at}.name", row.get("name"))
        rank = row.get("node_rank", i)
        port = row.get("port")
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise UserError(f"{at}.node_rank: an integer")
        if port is not None and (not isinstance(port, int) or not 1 <= port <= 65535):
            raise UserError(f"{at}.port: 1..65535")
        user = row.get("user")
        if user is not None and (not isinstance(user, str) or not _NAME.match(user) or user.startswith("-")):
            raise UserError(f"{at}.user: {user!r} is not a user name")
        dsv4 = row.get("dsv4", "dsv4")
        if not isinstance(dsv4, str) or not dsv4.strip():
            raise UserError(f"{at}.dsv4: the path of dsv4 on that host")
        hosts.append(FleetHost(name, rank, _host_word(f"{at}.address", row["address"]) if "address" in row else "",
                               user, port, _options(f"{at}.ssh_options", row.get("ssh_options")), dsv4,
                               _host_word(f"{at}.master_addr", row["master_addr"]) if "master_addr" in row else ""))
    config = raw.get("ssh_config")
    if config is not None and not isinstance(config, str):
        raise UserError(f"{where}: ssh_config: a path")
    launch = _launch_argv(where, raw["launch"]) if "launch" in raw else ()
    registry, insecure = raw.get("registry", ""), raw.get("insecure", False)
    if not isinstance(registry, str) or not isinstance(insecure, bool):
        raise UserError(f"{where}: registry is a string (HOST/REPO), insecure true or false")
    return _checked(Fleet(tuple(hosts), launch, str(Path(config).expanduser()) if config else None,
                          _options(f"{where}: ssh_options", raw.get("ssh_options")), where, registry, insecure))


def _checked(fleet: Fleet) -> Fleet:
    names = [h.name for h in fleet.hosts]
    if len(names) > MAX_HOSTS:
        raise UserError(f"{fleet.source}: {len(names)} hosts; at most {MAX_HOSTS}")
    if dup := next((n for n in names if names.count(n) > 1), None):
        raise UserError(f"{fleet.source}: host {dup} is named twice")
    ranks = sorted(h.node_rank for h in fleet.hosts)
    if ranks != list(range(len(ranks))):
        raise UserError(f"{fleet.source}: node ranks must be 0..{len(ranks) - 1}, each once (got {ranks})")
    return replace(fleet, hosts=tuple(sorted(fleet.hosts, key=lambda h: h.node_rank)))
