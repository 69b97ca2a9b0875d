"""`dsv4 bench …`: benchmarks printing side-by-side tables (one subcommand per bench)."""

from __future__ import annotations

import argparse
from pathlib import Path

from store.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser(
        "bench", help="benchmarks: side-by-side tables with ratios", description=__doc__
    )
    sub = group.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    cache = sub.add_parser(
        "cache",
        help="kernel cache: aoti cold compile vs cache HIT vs torch.compile; ls of 1,000 entries",
        description="Compile one sample program (a tiny MoE layer) with AOTInductor, load it "
        "from the cache, compare with torch.compile cold and warm, and time `cache ls` over "
        "1,000 synthetic entries. Runs compiles one at a time, each in its own process.",
    )
    cache.add_argument("--json", action="store_true", help="print one JSON object")
    cache.set_defaults(func=_cache)

    side = sub.add_parser(
        "sidecar",
        help="weight sidecar: packing vs load_file vs hot map vs cat; cold policies; probes; RSS",
        description="On one synthetic checkpoint and its sidecar: packing from the checkpoint "
        "(the baseline), safetensors load_file, our hot map + touch, cat from the page cache, "
        "the cold path per policy, residency probes (cachestat, mincore, fincore) of the "
        "sidecar and a 1 GiB file, and prepack's peak RSS, with the targets and whether each "
        "is met.",
    )
    side.add_argument(
        "--preset", choices=("tiny", "small", "medium"), default="small",
        help="synthetic checkpoint to measure on (made once under the user data dir)",
    )  # fmt: skip
    side.add_argument("--json", action="store_true",
                      help="print one JSON object: preset, hot_map_touch_vs_cat (target ≤ 1.5), rows")
    side.set_defaults(func=_sidecar)

    con = sub.add_parser(
        "console",
        help="dsv4-console: first paint, idle CPU (alone, beside 3 loaded services, with 16 fleet hosts), "
        "refresh seconds, residency refresh of a 300 GiB sidecar on mincore",
        description="Start dsv4-console in a pseudo-terminal on a tiny checkpoint: time to first "
        "paint, then its CPU use while idle (default 30 s at the default 2 s interval); again while "
        "three `dsv4 serve` of it run under load (targets: <= 3 % of a core, a refresh <= 0.5 s); then the "
        "residency refresh of a 300 GiB sparse sidecar on the mincore fallback (kernels before "
        "6.5): one sample, and the console's schedule over 300 refreshes (target <= 2 % of a core); then a "
        "fleet of --fleet-hosts namespaced sshd hosts on loopback (as root): a refresh of every host (target "
        "<= 2 s) and the fleet console's idle CPU, its ssh clients and masters included (target <= 3 %).",
    )
    con.add_argument("--idle-seconds", type=float, default=30.0, help="idle window (default 30)")
    con.add_argument("--fleet-hosts", type=int, default=16, metavar="N", help="hosts of the fleet part (default 16; "
                     "0 leaves it out)")
    con.add_argument("--json", action="store_true", help="print one JSON object")
    con.set_defaults(func=_console)

    eta = sub.add_parser(
        "eta",
        help="the console's compile ETA half-way through a real compile, against what was left",
        description="Compile a tiny checkpoint's programs twice with `dsv4 compile --jobs N` (the first run "
        "records each program's seconds); replay the second run's events through the console's tracker and "
        "compare its ETA at half the programs with the seconds really left, beside the old serial sum "
        "(target: within 25 %).",
    )
    eta.add_argument("--backend", choices=("export", "aoti"), default="export", help="compile backend")
    eta.add_argument("--jobs", type=int, default=2, help="compile workers (default 2)")
    eta.add_argument("--json", action="store_true", help="print one JSON object")
    eta.set_defaults(func=_eta)

    start = sub.add_parser(
        "startup",
        help="registration to serve-ready: cold vs warm programs vs warm + hot sidecar vs torch.compile",
        description="Registration to serve-ready (KV sized, validated), each set-up in a fresh "
        "process: cold-j1 (empty cache, one compile worker), early (cold, --ready early), cold (empty "
        "cache, the compile pool, no sidecar), warm (programs HIT, no sidecar), hot (programs HIT + a "
        "hot sidecar), peer (torch.compile with its own warm Inductor caches, packing). Per-phase "
        "seconds and ratios against the targets.",
    )
    from bench.startup_bench import SETUPS  # light: the set-ups run in child processes

    start.add_argument("--setups", default=",".join(SETUPS),
                       help=f"comma-separated set-ups to run (default all: {','.join(SETUPS)})")
    start.add_argument("--preset", choices=("tiny", "small", "medium"), default="small",
                       help="synthetic checkpoint to measure on (default %(default)s)")
    start.add_argument("--backend", choices=("aoti", "export"), default="aoti",
                       help="program backend of every set-up (default %(default)s)")
    start.add_argument("--json", action="store_true", help="print one JSON object")
    start.set_defaults(func=_startup)

    service = sub.add_parser(
        "service",
        help="HTTP service: one-sequence-per-step vs batched engine, 64 concurrent clients, tiny model",
        description="Serve the tiny synthetic model three times (one sequence per step, continuous "
        "batching, batching with MTP speculation) on loopback, send 2 rounds of 64 concurrent streamed "
        "completions to each and print throughput, p50/p99 latency, time to first token, server RSS and "
        "the ratios; on the batched server, all greedy vs half sampled (target ≥ 0.9×) and n=4 choices vs "
        "4 separate requests of one 128-token prompt; then the decode step time at max_seq 256 and 4096.",
    )
    service.add_argument("--backend", choices=("export", "aoti", "eager"), default="export",
                         help="program backend of every server (compiled once, then HIT)")
    service.add_argument("--json", action="store_true", help="print one JSON object")
    service.set_defaults(func=_service)

    hostile = sub.add_parser(
        "hostile",
        help="every hostile-request class against a live service: statuses, slowest answer, RSS/fds/slots before "
        "and after, each beside its bound",
        description="Serve the tiny synthetic model (eager, 2 slots, an API key, --read-timeout 10) and send each "
        "hostile class of issue 68: missing and wrong keys and paths that try to get round them, values past their "
        "bounds, float32 extremes, NaN and infinity, deep nesting, bad UTF-8, a 10 MB body, header floods, 100 "
        "slow-loris and 1 000 abandoned connections, clients leaving half-way, 4 MiB prompts (with /health and a "
        "small completion timed meanwhile) and the prompt count of n=2. Prints per class the requests, statuses, "
        "slowest answer, the service's RSS, descriptors and free slots before and after, and the bound it must hold.",
    )
    hostile.add_argument("--source", type=Path, metavar="DIR", help="serve from another checkout (its code first "
                         "on PYTHONPATH), to compare a release before this one; without keys where it has none")
    hostile.add_argument("--json", action="store_true", help="print one JSON object")
    hostile.set_defaults(func=_hostile)

    ranks = sub.add_parser(
        "ranks",
        help="dsv4 serve --ranks 1 vs 2 vs 4: ready cold/hot, mapped bytes, slots and PSS per rank, decode tokens/s",
        description="For each rank count N on one synthetic checkpoint and one kernel cache: a cold "
        "launch (no sidecar for N), `dsv4 prepack --ranks N` (timed), a hot launch on the hot sidecar with "
        "the same --device-memory per rank; registration to ready with rank 0's and the slowest rank's "
        "phases, each rank's mapped bytes (shared vs its experts), slots and KV bytes per rank and slots "
        "at N vs N=1 (target 0.95 × N), PSS and RSS per rank and the host memory added per extra rank "
        "against its target, decode tokens/s at 1, 16 and 32 concurrent requests beside the all-to-all "
        "time per engine call; then the per-page "
        "mapping cost projected onto V4-Flash for 1, 2, 4 and 8 ranks. Ratios against N=1.",
    )
    from bench.ranks_bench import RANKS  # light: torch is imported when the bench runs

    ranks.add_argument("--preset", choices=("tiny", "small"), default="small",
                       help="synthetic checkpoint to measure on (default %(default)s)")
    ranks.add_argument("--backend", choices=("export", "aoti", "eager"), default="export",
                       help="program backend of every launch (compiled by the first launch needing a key)")
    ranks.add_argument("--ranks", default=",".join(map(str, RANKS)),
                       help="comma-separated rank counts (default 1,2,4; counts that do not divide the "
                       "routed experts are skipped)")
    ranks.add_argument("--json", action="store_true", help="print one JSON object")
    ranks.set_defaults(func=_ranks)

    loss = sub.add_parser(
        "node-loss",
        help="two torchrun nodes on loopback, node 1 SIGKILLed or SIGSTOPped: seconds to 503 and to exit",
        description="docs/serving.md's multi-host recipe on one machine (two torchrun nodes of one rank, the tiny "
        "preset): node 1 killed (SIGKILL) or stopped (SIGSTOP), idle and under load; seconds from the loss "
        "to node 0's /health 503 and to its agent's exit, against 2 × --rank-timeout, and the status of "
        "every request in flight (target: 200 or 503 only).",
    )
    from runtime.launch.spec import DEFAULTS  # torch-free

    loss.add_argument("--rank-timeout", type=float, default=DEFAULTS.rank_timeout,
                      help="the services' --rank-timeout (default %(default)g)")
    loss.add_argument("--json", action="store_true", help="print one JSON object")
    loss.set_defaults(func=_node_loss)

    across = sub.add_parser(
        "hosts",
        help="one service over 2 namespaced hosts vs one node: cold and hot ready, programs compiled and shipped, "
        "tokens",
        description="On hosts in mount + UTS namespaces of this machine (as root), each with its own hostname, "
        "checkpoint copy, kernel cache, state dir and signing key, every host trusting the other's: a service of 2 "
        "ranks under torchrun over 2 hosts against one node, cold (empty caches) and hot; per host the programs it "
        "compiled, the entries it shipped, what it received (entries, bytes) and the seconds verifying them, when its "
        "programs phase ran; greedy validation tokens against one rank alone. Targets: cold ready over 2 hosts <= "
        "1.3x one node's, no program compiled twice in the service, tokens equal.",
    )
    across.add_argument("--preset", choices=("tiny", "small"), default="tiny",
                        help="synthetic checkpoint to measure on (default %(default)s; made in a temp dir)")
    across.add_argument("--backend", choices=("export", "aoti"), default="export",
                        help="how the programs compile (default %(default)s)")
    across.add_argument("--json", action="store_true", help="print one JSON object")
    across.set_defaults(func=_hosts)

    acc = sub.add_parser(
        "accelerator",
        help="the whole path on one device: cold and hot launch, upload GB/s, memory, console, greedy vs cpu, tok/s",
        description="One prepared run on --device (bench/accelerator.sh runs it on a bare GPU host from carried "
        "wheels): per preset, synthesise; a cold `dsv4 serve` (every program compiled into an empty kernel "
        "cache, weights packed); prepack and warm the sidecar; on an accelerator, the upload of the mapped "
        "sidecar through one and two staging buffers beside pinned and pageable copies; a hot launch "
        "(programs HIT, sidecar MAP) and beside it the device's memory, `dsv4-console --once --json`'s Device "
        "pane against the runtime's figures, greedy completions against the cpu eager reference (equal, or "
        "log-probabilities within a stated tolerance with the first divergent position), and decode tokens/s "
        "under concurrent requests. Every figure goes into OUT/accelerator.json, rewritten after each step. "
        "Exits 1 when a step fails (its error is among the figures) or the greedy tokens disagree beyond the "
        "tolerance.",
    )
    from bench.accelerator_bench import GREEDY_TOKENS, LOADS  # light: torch runs in child processes

    acc.add_argument("--out", type=Path, required=True,
                     help="results directory: accelerator.json (and the work files, unless --work)")
    acc.add_argument("--work", type=Path, default=None,
                     help="checkpoints, kernel caches and service logs (default OUT/work; each preset's is "
                     "replaced on a rerun)")
    acc.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto",
                     help="device to serve on (default %(default)s: npu > cuda > cpu)")
    acc.add_argument("--preset", default="small",
                     help="comma-separated synthetic presets, run in turn (tiny, small, medium; default %(default)s)")
    acc.add_argument("--backend", choices=("aoti", "export", "eager"), default="aoti",
                     help="program backend of both launches (default %(default)s: AOTInductor)")
    acc.add_argument("--loads", default=",".join(map(str, LOADS)),
                     help="comma-separated concurrent request counts for decode tokens/s (default %(default)s)")
    acc.add_argument("--greedy-tokens", type=int, default=GREEDY_TOKENS,
                     help="greedy tokens per prompt compared with the cpu reference (default %(default)s)")
    acc.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    acc.set_defaults(func=_accelerator)

    plan = sub.add_parser(
        "plan",
        help="fresh-process `dsv4 plan --json` on the small and the full V4-Flash layout",
        description="Time `dsv4 plan --json` in a fresh process on header-only checkpoints of the "
        "small preset and of V4-Flash (sparse shards), against the 0.5 s / 2 s targets; report the "
        "sidecar a prepack would write (sidecar.expected_bytes) against the checkpoint's bytes "
        "(target ≤ 1.02×) and V4-Flash's bytes per tensor family.",
    )
    plan.add_argument("--runs", type=int, default=5, help="runs per layout (median reported)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(func=_plan)

    packing = sub.add_parser(
        "packing",
        help="packer 4 (FP4 two codes a byte) vs packer 2's layout (FP4 as int8): bytes, decode, prefill",
        description="In one process on one checkpoint: packer 4's tensors and packer 2's rebuilt from "
        "them in memory (exact), run by the same model code: the packed bytes against the checkpoint's, "
        "eager decode-step time and prefill tokens/s, greedy tokens (equal), and one layer's routed "
        "experts compiled by inductor (picked path at 1 and 16 rows, dense at 256). Targets: decode "
        "≥ 1.0×, prefill ≥ 0.9×.",
    )
    packing.add_argument("--preset", choices=("tiny", "small", "medium"), default="small",
                         help="synthetic checkpoint to measure on (default %(default)s; made on first use)")
    packing.add_argument("--json", action="store_true", help="print one JSON object")
    packing.set_defaults(func=_packing)

    roof = sub.add_parser(
        "roofline",
        help="each step against this host's limit: decode vs memory bandwidth, prefill vs GEMM rate, by program family",
        description="On the preset's checkpoint, launched in this process (no MTP): this host's memory bandwidth "
        "(a read-only pass and a STREAM triad on the service's threads) and float32 GEMM rate at each shape a "
        "prefill multiplies; a decode step of 1, 8 and 32 rows against the bytes it must read (each weight once, "
        "the routed experts its rows picked, the head, the KV rows) and a prefill of 256 and 1024 tokens against "
        "its GEMM bound, each split by program family so the least efficient part is named, and a decode "
        "step's native products timed within it (with the share of the bound a step of those alone would "
        "reach: what these kernels allow); all in turns. "
        "Targets: decode ≥ 70 % of the bound at 1 row, the 8-row step ≤ 1.5× the 1-row step, a 1024-token "
        "prefill ≥ 50 % of the GEMM bound. --json keys: bandwidth_gbs, decode_share_1, decode_share_8, "
        "step_8_vs_1, prefill_share_1024, products_ceiling_1.",
    )
    roof.add_argument("--preset", choices=("tiny", "small", "medium"), default="small",
                      help="synthetic checkpoint (default %(default)s; made on first use)")
    roof.add_argument("--backend", choices=("aoti", "export", "eager"), default="aoti",
                      help="program backend (default %(default)s; compiled on the first run)")
    roof.add_argument("--products", action="store_true",
                      help="only the native products (FP8, FP4, BF16 at 1-8 rows, weights from memory, and again "
                      "from the caches: what their arithmetic allows) against the read bandwidth: the kernels' "
                      "micro-benchmark")
    roof.add_argument("--json", action="store_true", help="print one JSON object")
    roof.set_defaults(func=_roofline)

    comp = sub.add_parser(
        "compile",
        help="a launch's programs compiled cold in both program forms: routed experts apart vs inside each layer",
        description="On the preset's checkpoint, in one run with the same compile workers: every program of "
        "the launch compiled cold (empty kernel and Inductor caches) in the form before issue 37 (each layer "
        "program with its routed experts inside: the baseline) and in today's (one pair of experts programs "
        "that every layer calls); the programs phase, compile seconds per family of programs, the longest "
        "program, then greedy tokens (equal) and decode steps from both caches. Target: programs phase "
        "≤ 0.7× the baseline's. --json keys: programs_s, baseline_programs_s, ratio.",
    )
    comp.add_argument("--preset", choices=("tiny", "small", "medium"), default="small",
                      help="synthetic checkpoint (default %(default)s; made on first use)")
    comp.add_argument("--backend", choices=("aoti", "export"), default="aoti",
                      help="how the programs compile (default %(default)s)")
    comp.add_argument("--jobs", type=int, default=None, metavar="N",
                      help="compile workers of both forms (default: a launch's, the CPUs capped by memory)")
    comp.add_argument("--json", action="store_true", help="print one JSON object")
    comp.set_defaults(func=_compile)

    peer = sub.add_parser(
        "peer",
        help="dsv4 serve against transformers' generate on the same weights: decode tokens/s and TTFT at 1 and 8",
        description="On the preset's checkpoint: a `dsv4 serve` (streamed greedy completions, 1 request and 8 at "
        "once) against Hugging Face transformers' DeepseekV4ForCausalLM.generate (float32, the same weights "
        "dequantised, KV cache on, a batch of 1 and of 8), on the same torch threads, one after the other: decode "
        "tokens/s and time to first token, ratios service ÷ transformers (above 1 faster), greedy tokens equal; "
        "then where a service decode step goes (program families, the engine around them, sampling, and what is "
        "left: scheduling, streaming, HTTP). Target: decode ≥ 1.0× at both on small with a compiled backend. "
        "Needs transformers (the test extra). --json keys: decode_ratio_1, decode_ratio_8, tokens_equal.",
    )
    from bench.peer_bench import (  # light: torch is imported when the bench runs
        NEW_TOKENS,
        PROMPT_TOKENS,
    )

    peer.add_argument("--preset", choices=("tiny", "small", "medium"), default="tiny",
                      help="synthetic checkpoint (default %(default)s; made on first use)")
    peer.add_argument("--backend", choices=("aoti", "export", "eager"), default="aoti",
                      help="program backend of the service (default %(default)s, as `dsv4 serve` on the cpu; "
                      "compiled on the first run)")
    peer.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, metavar="N",
                      help="tokens of each prompt (default %(default)s)")
    peer.add_argument("--new-tokens", type=int, default=NEW_TOKENS, metavar="N",
                      help="greedy tokens generated per prompt (default %(default)s)")
    peer.add_argument("--peer", choices=("transformers", "llama.cpp"), default="transformers",
                      help="the other side: transformers' generate (float32, default), or llama.cpp's llama-server "
                      "built once from the llama-cpp-python package's vendored sources (cached under the user cache "
                      "dir), the checkpoint converted by its own converter at its own types (and at float32 for the "
                      "tokens); --json keys llamacpp_decode_ratio_1, llamacpp_decode_ratio_8")
    peer.add_argument("--json", action="store_true", help="print one JSON object")
    peer.set_defaults(func=_peer)

    ship = sub.add_parser(
        "cache-ship",
        help="a launch's programs: cold compile vs pull from a local registry vs import of a bundle",
        description="On one synthetic checkpoint, each in its own processes: compile every program cold "
        "(`dsv4 compile`), pull them from a docker-registry started on 127.0.0.1 (`cache pull`), import "
        "them from a bundle (`cache import`), each followed by a launch that HITs: seconds, bytes, and "
        "pull + verify against the compile (target ≤ 5 %). Without docker-registry installed, no pull row.",
    )
    ship.add_argument("--preset", choices=("tiny", "small", "medium"), default="small",
                      help="synthetic checkpoint (default %(default)s; made in a temp dir)")
    ship.add_argument("--backend", choices=("aoti", "export"), default="aoti",
                      help="how the programs compile (default %(default)s)")
    ship.add_argument("--json", action="store_true", help="print one JSON object")
    ship.set_defaults(func=_cache_ship)


def _compile(args: argparse.Namespace) -> int:
    from bench.compile_bench import main

    if args.jobs is not None and args.jobs < 1:
        raise UserError("--jobs: 1 or more")
    return main(preset=args.preset, backend=args.backend, jobs=args.jobs, json_output=args.json)


def _peer(args: argparse.Namespace) -> int:
    from bench.peer_bench import main

    if args.prompt_tokens < 1 or args.new_tokens < 2:
        raise UserError("--prompt-tokens: 1 or more; --new-tokens: 2 or more (decode follows the first token)")
    return main(preset=args.preset, backend=args.backend, json_output=args.json,
                prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, peer=args.peer)


def _eta(args: argparse.Namespace) -> int:
    from console.benches.eta_bench import main

    return main(json_output=args.json, backend=args.backend, jobs=args.jobs)


def _startup(args: argparse.Namespace) -> int:
    from bench.startup_bench import main

    return main(preset=args.preset, backend=args.backend, json_output=args.json,
                setups=tuple(s.strip() for s in args.setups.split(",") if s.strip()))


def _console(args: argparse.Namespace) -> int:
    from console.benches.console_bench import main

    if args.fleet_hosts < 0:
        raise UserError("--fleet-hosts: 0 or more")
    return main(json_output=args.json, idle_seconds=args.idle_seconds, fleet_hosts=args.fleet_hosts)


def _hostile(args: argparse.Namespace) -> int:
    from bench.hostile_bench import main

    if args.source is not None and not (args.source / "runtime" / "serve").is_dir():
        raise UserError(f"--source {args.source}: not a dsv4-console checkout (no runtime/serve in it)")
    return main(json_output=args.json, source=args.source)


def _accelerator(args: argparse.Namespace) -> int:
    from bench.accelerator_bench import main

    presets = [p.strip() for p in args.preset.split(",") if p.strip()]
    if not presets or any(p not in ("tiny", "small", "medium") for p in presets):
        raise SystemExit(f"dsv4 bench accelerator: --preset {args.preset}: choose from tiny, small, medium")
    try:
        loads = [int(n) for n in args.loads.split(",") if n.strip()]
    except ValueError:
        loads = []
    if not loads or min(loads) < 1 or max(loads) > 4096:
        raise SystemExit(f"dsv4 bench accelerator: --loads {args.loads}: comma-separated counts 1..4096")
    if not 1 <= args.greedy_tokens <= 128:
        raise SystemExit(f"dsv4 bench accelerator: --greedy-tokens {args.greedy_tokens}: allowed 1..128")
    return main(args.device, presets, args.out, backend=args.backend, loads=loads,
                greedy_tokens=args.greedy_tokens, json_output=args.json, work=args.work)


def _main(module: str, *same: str, **renamed: str):
    """A bench whose `main` takes these flags as keywords (`same` by their own names; `renamed`:
    main's keyword = the flag's name), its module imported only when it runs (torch with it)."""
    def run(args: argparse.Namespace) -> int:
        from importlib import import_module

        keywords = {n: getattr(args, n) for n in same} | {k: getattr(args, v) for k, v in renamed.items()}
        return import_module(f"bench.{module}").main(**keywords)
    return run


_roofline = _main("roofline_bench", "preset", "backend", "products", json_output="json")
_cache_ship = _main("cache_ship_bench", "preset", "backend", json_output="json")
_cache = _main("cache_bench", json_output="json")
_sidecar = _main("sidecar_bench", "preset", json_output="json")
_service = _main("service_bench", "backend", json_output="json")
_ranks = _main("ranks_bench", "preset", "backend", "ranks", json_output="json")
_hosts = _main("hosts_bench", "preset", "backend", json_output="json")
_node_loss = _main("node_loss_bench", "rank_timeout", json_output="json")
_plan = _main("plan_bench", "runs", as_json="json")
_packing = _main("packing_bench", "preset", json_output="json")
