"""One launch as a value: the `LaunchSpec`, its flags, and its argv.

Every setting of a launch is one field of `LaunchSpec`, described once in `FLAGS` (flag, help,
default, allowed range): `add_flags` puts a command's flags on its parser, `from_args` reads
them back (one line and exit 1 for a value out of range), `argv` turns a spec into the very
flags that command parses. The plan, registration, the `dsv4 serve` process, the rank launcher
and the console all take this value, so what the console shows and does is what the launch
does. Torch-free (the console imports it).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from runtime.model.dims import MAX_SLOTS
from store.errors import UserError
from store.units import format_size, parse_size

# The commands that take launch settings; each takes the fields its FLAGS entry names.
SERVE, COMPILE, PLAN, CONSOLE, PREPACK, CACHE, SIDECAR_PURGE = (
    "serve", "compile", "plan", "console", "prepack", "cache", "sidecar purge")
LAUNCH = (SERVE, CONSOLE)  # the whole spec: the console launches what `dsv4 serve` would
READY_CHOICES = ("compiled", "early", "auto")
COMPILE_AFTER_READY_CHOICES = ("warn", "error")  # runtime.programs.after_ready.MODES


@dataclass(frozen=True)
class LaunchSpec:
    """What one launch is asked to do. Defaults here are the only place they are written."""

    model: Path | None = None  # None: the embedded default checkpoint
    kernel_cache_dir: Path | None = None  # None: $DSV4_KERNEL_CACHE_DIR, else the user cache dir
    backend: str = "auto"
    device: str = "auto"
    ranks: int = 1
    max_seq: int = 1024
    max_slots: int = 32
    max_batch: int | None = None  # None: every KV slot
    memory_utilization: float = 0.9
    device_memory: int | None = None
    use_sidecar: bool = True
    cold_policy: str = "auto"
    ready: str = "compiled"
    compile_after_ready: str = "warn"
    jobs: int | None = None  # None: the CPUs this process may use, capped by memory
    speculative: str = "auto"
    validate_tokens: int = 8
    max_body: int = 4 << 20  # 4 MiB: ~1M tokens of text; far past any context served here
    queue_timeout: float = 30.0
    host: str = "127.0.0.1"
    port: int = 8000
    master_port: int | None = None
    rendezvous_timeout: float = 60.0
    rank_timeout: float = 5.0  # a rank whose heartbeat is silent this long is lost
    stall_timeout: float = 600.0  # a rank others wait for may show no progress this long
    signing_key: Path | None = None  # None: $DSV4_SIGNING_KEY, else the user config dir's signing.key
    trusted_keys: Path | None = None  # None: $DSV4_TRUSTED_KEYS (unset: no other host's entries)
    events: str | None = None
    # At the door (runtime.serve.auth, runtime.serve.tls): secrets are files, never flag values
    api_key_file: Path | None = None  # None: $DSV4_API_KEY_FILE (unset: no key needed)
    status_needs_key: bool = True  # with keys, /health and /metrics need one too (--open-status: not)
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    ssl_ca_certs: Path | None = None  # client certificates must be signed by this CA
    ca_file: Path | None = None  # a client's (the console's): the CA of the services' certificates
    read_timeout: float = 10.0  # a request's head, and each piece of its body, within this
    root_path: str = ""  # the prefix a proxy in front strips (uvicorn's --root-path)
    # What happened (runtime.log): the service's log, as text or JSON lines, and where it is kept
    log_format: str = "text"
    log_file: Path | None = None  # None: <state dir>/services/logs/serve-<port>.log

    def with_(self, **changes: Any) -> LaunchSpec:
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """Every field, paths as text (what a plan and a snapshot carry)."""
        return {f.name: str(v) if isinstance(v := getattr(self, f.name), Path) else v for f in fields(self)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> LaunchSpec:
        """`to_json`'s inverse: fields the sender lacks keep their defaults, unknown ones are
        dropped (another dsv4's settings), paths come back as paths."""
        known = {f.name: raw[f.name] for f in fields(cls) if f.name in raw}
        for name in PATH_FIELDS:
            if known.get(name) is not None:
                known[name] = Path(known[name])
        return cls(**known)

    def argv(self, command: str) -> list[str]:
        """The flags of `command` that say this spec (defaults left out); `from_args` of them
        gives this spec back."""
        out: list[str] = []
        for flag in FLAGS:
            if command not in flag.commands:
                continue
            value = getattr(self, flag.field)
            if flag.field == "model":
                if value is not None:
                    out += [str(value)] if command not in NAMED_MODEL else ["--model", str(value)]
                continue
            if value == default_of(flag, command):
                continue
            if flag.negate:
                out.append(flag.flag)  # the one non-default value of a switch
            else:
                out += [flag.flag, flag.show(value)]
        return out

    def check(self) -> None:
        """One line for a setting out of range, a model that is not a directory, or settings
        that cannot go together."""
        if self.model is not None and not Path(self.model).expanduser().is_dir():
            what = "no such directory" if not Path(self.model).expanduser().exists() else "not a directory"
            raise UserError(f"{self.model}: {what}; point at a checkpoint directory (the one holding "
                            f"config.json)")
        for flag in FLAGS:
            value = getattr(self, flag.field)
            if flag.lo is not None and value is not None and not (flag.lo <= value <= flag.hi):
                raise UserError(f"{flag.flag} {flag.show(value)} is out of range; allowed "
                                f"{flag.allowed or f'{flag.lo}..{flag.hi}'}")
        if self.ready == "early" and self.ranks > 1:
            raise UserError("--ready early serves one rank only (each rank would compile the same programs); "
                            "use --ready compiled (or auto) with --ranks")
        if self.events not in (None, "-"):
            events = Path(self.events)
            if not events.parent.is_dir():
                raise UserError(f"--events {self.events}: directory {events.parent} does not exist; create it "
                                f"or choose another path")
            if events.exists() and not events.is_file():  # appending to a FIFO would block for a reader
                raise UserError(f"--events {self.events}: not a regular file; choose another path")
        if self.log_file is not None and Path(self.log_file).expanduser().is_dir():
            raise UserError(f"--log-file {self.log_file}: a directory; name a file (its directory must exist)")
        if self.log_file is not None and not Path(self.log_file).expanduser().parent.is_dir():
            raise UserError(f"--log-file {self.log_file}: directory {Path(self.log_file).parent} does not exist; "
                            f"create it or choose another path")
        if self.root_path and not (self.root_path.startswith("/") and not self.root_path.endswith("/")
                                   and self.root_path.isascii() and self.root_path.isprintable()):
            raise UserError(f"--root-path {self.root_path!r}: a path prefix like /dsv4 (starting with /, "
                            f"not ending with one)")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise UserError("--ssl-certfile and --ssl-keyfile go together (the certificate and its private key)")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise UserError("--ssl-ca-certs asks clients for certificates: it needs --ssl-certfile and --ssl-keyfile")


PATH_FIELDS = ("model", "kernel_cache_dir", "signing_key", "trusted_keys")
DEFAULTS = LaunchSpec()
DEFAULTS_OF = {f.name: getattr(DEFAULTS, f.name) for f in fields(LaunchSpec)}
NAMED_MODEL = (CONSOLE, CACHE)  # commands that take `--model DIR` instead of a positional MODEL_DIR


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@dataclass(frozen=True)
class Flag:
    field: str
    flag: str
    help: str
    commands: tuple[str, ...]
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    lo: float | None = None
    hi: float | None = None
    allowed: str = ""  # the allowed range in words, when lo..hi says it badly
    negate: bool = False  # a switch that sets the field to False (`--no-sidecar`)
    defaults: dict[str, Any] = field(default_factory=dict)  # command → its own default, if it differs

    def show(self, value: Any) -> str:
        return str(value)


ALL = (SERVE, COMPILE, PLAN, CONSOLE, CACHE)
PLANNED = (SERVE, PLAN, CONSOLE)
FLAGS: tuple[Flag, ...] = (
    Flag("model", "MODEL_DIR", "checkpoint directory (default: the embedded synthetic checkpoint, made on first "
         "run)", (*ALL, PREPACK, SIDECAR_PURGE), type=Path),
    Flag("kernel_cache_dir", "--kernel-cache-dir", "kernel cache root (default: $DSV4_KERNEL_CACHE_DIR, else the "
         "user cache dir)", ALL, type=Path, metavar="DIR"),
    Flag("backend", "--backend", "aoti (AOTInductor, default on cpu/cuda), export (torch.export; npu), eager "
         "(no kernel cache); default %(default)s", ALL, choices=("auto", "aoti", "export", "eager")),
    Flag("device", "--device", "cpu, cuda or npu; auto (the default): npu > cuda > cpu, as this host has them", ALL,
         choices=("auto", "cpu", "cuda", "npu")),
    Flag("ranks", "--ranks", "expert-parallel rank processes, one per device (default 1; under torchrun "
         "WORLD_SIZE)", (*ALL, PREPACK, SIDECAR_PURGE), type=int, metavar="N", lo=1, hi=4096),
    Flag("max_seq", "--max-seq", f"context length per KV slot (default {DEFAULTS.max_seq})", ALL, type=int, metavar="N",
         lo=16, hi=1 << 24),
    Flag("max_slots", "--max-slots", f"KV slots per rank: at most this many of its sequences decode together (default "
         f"{DEFAULTS.max_slots}; fewer if its memory is short)", (SERVE, PLAN, CONSOLE), type=int, metavar="N",
         lo=1, hi=MAX_SLOTS),
    Flag("max_batch", "--max-batch", "sequences that decode together in one step (default: every KV slot; 1: one "
         "at a time)", LAUNCH, type=int, metavar="N", lo=1, hi=MAX_SLOTS),
    Flag("memory_utilization", "--memory-utilization", f"fraction of device memory the service may use (KV "
         f"budget = total × this − used; default {DEFAULTS.memory_utilization})", PLANNED, type=float, metavar="F",
         lo=1e-3, hi=1.0, allowed="above 0 up to 1"),
    Flag("device_memory", "--device-memory", "cap each rank's device memory, e.g. 8G (on cpu: each rank's simulated "
         "device; without it a host's ranks split its memory)", PLANNED,
         type=_size, metavar="SIZE", lo=1, hi=1 << 60, allowed="at least 1 byte"),
    Flag("use_sidecar", "--no-sidecar", "always pack from the checkpoint, never map a sidecar", PLANNED,
         negate=True),
    Flag("cold_policy", "--cold-policy", "a valid sidecar not in the page cache: reject (repack), read it, or "
         "auto (whichever is predicted faster); default %(default)s", PLANNED,
         choices=("reject", "read", "auto")),
    Flag("ready", "--ready", "compiled: serve once every program is compiled; early: serve on the eager tier at "
         "once and swap each program in as it compiles (one rank only); auto: early when the plan misses "
         "programs and one rank serves, else compiled (default %(default)s)", (*LAUNCH, PLAN), choices=READY_CHOICES,
         defaults={CONSOLE: "auto"}),
    Flag("compile_after_ready", "--compile-after-ready", "a program compiled, loaded or specialised after the "
         "service turned ready (dsv4_compiles_after_ready_total; --ready early's tier swaps are counted, never "
         "refused): warn logs it, error fails the step that did it (default %(default)s)", LAUNCH,
         choices=COMPILE_AFTER_READY_CHOICES),
    Flag("jobs", "--jobs", "compile missing programs in N worker processes (default: the CPUs this process "
         "may use, capped by memory)", (SERVE, COMPILE, CONSOLE), type=int, metavar="N", lo=1, hi=1024),
    Flag("speculative", "--speculative", "mtp: the MTP layer drafts a token that the main model verifies in "
         "the same step (greedy requests; tokens unchanged); auto: mtp on a real checkpoint with an MTP "
         "layer, off on synthetic ones (default %(default)s)", LAUNCH, choices=("auto", "mtp", "off")),
    Flag("validate_tokens", "--validate-tokens", f"greedy decode steps of the validate phase "
         f"(default {DEFAULTS.validate_tokens})", LAUNCH,
         type=int, metavar="N", lo=1, hi=4096),
    Flag("max_body", "--max-body", f"largest request body accepted, larger is 413 "
         f"(default {format_size(DEFAULTS.max_body)})", LAUNCH,
         type=_size, metavar="SIZE", lo=1024, hi=1 << 40, allowed="1K..1T"),
    Flag("queue_timeout", "--queue-timeout", f"seconds a request waits for a free slot before 503 + Retry-After "
         f"(default {DEFAULTS.queue_timeout:g})", LAUNCH, type=float, metavar="SECONDS", lo=0.001, hi=86400,
         allowed="above 0 up to 86400 seconds"),
    Flag("host", "--host", f"listen address (default {DEFAULTS.host}: loopback only)", LAUNCH, metavar="ADDR"),
    Flag("port", "--port", f"listen port (default {DEFAULTS.port}; 0: any free port)", LAUNCH, type=int, metavar="N",
         lo=0, hi=65535, allowed="0..65535 (0: any free port)"),
    Flag("master_port", "--master-port", "--ranks N: port of the ranks' rendezvous on 127.0.0.1 (default "
         "$MASTER_PORT, else any free port)", LAUNCH, type=int, metavar="P", lo=1, hi=65535),
    Flag("rendezvous_timeout", "--rendezvous-timeout", f"seconds every rank has to join the service "
         f"(default {DEFAULTS.rendezvous_timeout:g})", LAUNCH, type=float, metavar="SECONDS", lo=0.1, hi=86400,
         allowed="above 0 up to 86400 seconds"),
    Flag("stall_timeout", "--stall-timeout", f"at a registration sync point the other ranks wait for a slower one "
         f"while it is alive and its progress (programs compiled, layers loaded) moves; one whose progress "
         f"stands still this many seconds is named and the launch fails (default {DEFAULTS.stall_timeout:g})",
         LAUNCH, type=float, metavar="SECONDS", lo=1, hi=86400, allowed="1 to 86400 seconds"),
    Flag("rank_timeout", "--rank-timeout", f"seconds a rank's heartbeat may be silent before the service counts it "
         f"lost (dead, stopped or cut off) and fails closed (default {DEFAULTS.rank_timeout:g})", LAUNCH,
         type=float, metavar="SECONDS", lo=0.5, hi=3600, allowed="0.5 to 3600 seconds"),
    Flag("signing_key", "--signing-key", "across hosts: the private key this host signs the programs it compiles "
         "for the others with, readable by its owner only (default $DSV4_SIGNING_KEY, else <user config dir>/"
         "dsv4-console/signing.key; `dsv4 keys generate` makes one)", (*LAUNCH, PLAN), type=Path, metavar="FILE"),
    Flag("trusted_keys", "--trusted-keys", "across hosts: the public keys whose signed programs this host installs "
         "instead of compiling them (default $DSV4_TRUSTED_KEYS; none: each host compiles what it misses)",
         (*LAUNCH, PLAN), type=Path, metavar="FILE"),
    Flag("events", "--events", "write progress events as JSON lines to FILE (- for stdout)",
         (SERVE, COMPILE, PREPACK), metavar="FILE|-"),
    Flag("api_key_file", "--api-key-file", "API keys, one `NAME KEY` a line, private to you (mode 600): every "
         "request then needs `Authorization: Bearer KEY`; the console and fleet send the file's first key (default "
         "$DSV4_API_KEY_FILE; none: no key needed)", LAUNCH, type=Path, metavar="FILE"),
    Flag("status_needs_key", "--open-status", "with --api-key-file: /health and /metrics answer without a key "
         "(a load balancer's probe, a scraper without one); every other path still needs it", LAUNCH, negate=True),
    Flag("ssl_certfile", "--ssl-certfile", "serve HTTPS with this certificate (PEM; with --ssl-keyfile)", LAUNCH,
         type=Path, metavar="FILE"),
    Flag("ssl_keyfile", "--ssl-keyfile", "the certificate's private key (PEM), private to you (mode 600)", LAUNCH,
         type=Path, metavar="FILE"),
    Flag("ssl_ca_certs", "--ssl-ca-certs", "with HTTPS: every client must present a certificate signed by a CA of "
         "this file (PEM)", LAUNCH, type=Path, metavar="FILE"),
    Flag("ca_file", "--ca-file", "the CA certificates (PEM) that vouch for the services' HTTPS certificates "
         "(default $DSV4_CA_FILE; else the system's); a certificate they do not verify is refused", (CONSOLE,),
         type=Path, metavar="FILE"),
    Flag("read_timeout", "--read-timeout", f"seconds a client has to send a request's head, and to send each piece "
         f"of its body; past them its connection is closed (default {DEFAULTS.read_timeout:g})", LAUNCH, type=float,
         metavar="SECONDS", lo=0.1, hi=3600, allowed="0.1 to 3600 seconds"),
    Flag("root_path", "--root-path", "the path prefix a proxy in front of the service strips before forwarding "
         "(uvicorn's --root-path; default none)", LAUNCH, metavar="PREFIX"),
    Flag("log_format", "--log-format", "the service's log (a line per request, a summary every 10 s, each phase "
         "and warning): text lines, or json lines with the same words and each figure a field (default %(default)s)",
         LAUNCH, choices=("text", "json")),
    Flag("log_file", "--log-file", "where the service keeps its log, capped and rotated, the previous run's beside it "
         "as NAME.prev.log (default <state dir>/services/logs/serve-PORT.log; rank r of several: NAME.rankR.log)",
         (SERVE,), type=Path, metavar="FILE"),
)


FLAGS_BY_FIELD = {f.field: f for f in FLAGS}


def default_of(flag: Flag, command: str) -> Any:
    return flag.defaults.get(command, DEFAULTS_OF[flag.field])


def flags_of(command: str) -> list[Flag]:
    return [f for f in FLAGS if command in f.commands]


def add_flags(parser: argparse.ArgumentParser, command: str, *, model_help: str | None = None,
              model_required: bool = False) -> None:
    """Put `command`'s launch flags on `parser` (dest = the spec's field names)."""
    for flag in flags_of(command):
        default = default_of(flag, command)
        if flag.field == "model":
            text = model_help or flag.help
            if command in NAMED_MODEL:
                parser.add_argument("--model", dest="model", type=Path, metavar="DIR", help=text)
            else:
                parser.add_argument("model", metavar="MODEL_DIR", type=Path, help=text,
                                    **({} if model_required else {"nargs": "?"}))
            continue
        if flag.negate:
            parser.add_argument(flag.flag, dest=flag.field, action="store_false", help=flag.help)
            continue
        kw: dict[str, Any] = {"dest": flag.field, "help": flag.help, "default": default}
        if flag.field == "ranks":
            kw["default"] = None  # unset: 1, or WORLD_SIZE under torchrun (`from_args(world=…)`)
        if flag.type is not None:
            kw["type"] = flag.type
        if flag.choices is not None:
            kw["choices"] = flag.choices
        if flag.metavar is not None:
            kw["metavar"] = flag.metavar
        parser.add_argument(flag.flag, **kw)


def from_args(args: argparse.Namespace, command: str, *, world: int | None = None) -> LaunchSpec:
    """The spec `command`'s parsed flags say (fields the command has no flag for keep their
    defaults), checked: one line for a value out of range. `world`: WORLD_SIZE under torchrun,
    which an unset --ranks takes and a set one must equal."""
    values = {f.field: getattr(args, f.field) for f in flags_of(command) if hasattr(args, f.field)}
    ranks = values.get("ranks")
    if world is not None:
        if ranks not in (None, world):
            raise UserError(f"--ranks {ranks} but WORLD_SIZE={world} (torchrun's ranks); drop --ranks or make "
                            f"them agree")
        ranks = world
    values["ranks"] = 1 if ranks is None else ranks
    spec = LaunchSpec(**values)
    spec.check()
    return spec


def parser_for(command: str) -> argparse.ArgumentParser:
    """A parser of `command`'s launch flags alone (the round-trip test, and `parse`)."""
    parser = argparse.ArgumentParser(prog=f"dsv4 {command}", add_help=False)
    add_flags(parser, command)
    return parser


def parse(argv: Sequence[str], command: str) -> LaunchSpec:
    """`argv` (launch flags of `command` only) → the spec: `argv`'s inverse."""
    return from_args(parser_for(command).parse_args(list(argv)), command)


__all__ = ["DEFAULTS", "FLAGS", "LaunchSpec", "add_flags", "from_args", "parse"]
