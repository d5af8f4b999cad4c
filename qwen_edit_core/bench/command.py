"""`qwen-edit bench WHAT`: the dispatch from the parsed command line to each benchmark."""

from __future__ import annotations


def run_bench(args) -> None:
    """Runs the benchmark `args.what` with the options `qwen-edit bench` parsed (each imported only when asked for)."""
    if args.what == "soak":
        from qwen_edit_core.bench.soak import run
        report = run(rounds=args.rounds)
        if report.recovered < report.injected:
            raise SystemExit(1)
    elif args.what == "sample":  # no --variant: every family's table(s); a --variant: only its family's
        from qwen_edit_core.bench.sample import run
        from qwen_edit_core.families import variants
        if args.variant is not None:
            run = variants.get(args.variant).family.stage("sample_bench").run
        run(real_size=args.real_size, device=args.device, steps=args.steps, repeats=args.repeats)
    elif args.what == "threads":
        from qwen_edit_core.bench.threads import run
        run(repeats=args.repeats)
    elif args.what == "batching":
        from qwen_edit_core.bench.batching import run
        run(real_size=args.real_size, device=args.device, repeats=args.repeats)
    elif args.what == "doctor":
        from qwen_edit_core.bench.doctor import run
        run()
    elif args.what == "cache":
        from qwen_edit_core.bench.cache import run
        run(pairs=args.pairs, processes=args.processes)
    elif args.what == "attention":
        from qwen_edit_core.bench.attention import run
        run(device=args.device, repeats=args.repeats)
    elif args.what == "activations":
        from qwen_edit_core.bench.activations import run
        run(device=args.device)
    elif args.what == "memory":
        from qwen_edit_core.bench.memory import check_edit
        from qwen_edit_core.families import variants
        variant = variants.DEFAULT if args.variant is None else args.variant
        check_edit(variant, args.size, args.controls)
        if args.fp8_copy:  # the Sampling Speed node's fp8 copy of the real-size transformer
            from qwen_edit_core.bench.memory_fp8_copy import report as fp8_copy_report
            print(fp8_copy_report(variant, as_json=args.json))  # noqa: T201
        elif args.sample:  # sampling on a card of --budget-gb GiB (default 24 and 48)
            from qwen_edit_core.bench.memory_sample import report as sample_report
            report = sample_report(variant, args.size, args.controls, args.budget_gb, as_json=args.json)
            print(report)  # noqa: T201
        elif args.comfyui:  # the Train node's job on a card of --budget-gb GiB (default 24)
            from qwen_edit_core.bench.memory_comfyui import report as comfyui_report
            print(comfyui_report(variant, args.size, args.controls, args.budget_gb,  # noqa: T201
                                 file_dtype=args.file_dtype, as_json=args.json))
        else:
            from qwen_edit_core.bench.memory import report
            print(report(variant, args.size, args.controls, args.budget_gb, as_json=args.json))  # noqa: T201
    else:
        from qwen_edit_core.bench.train import run
        run(real_size=args.real_size, device=args.device, steps=max(args.steps, 3),
            variants=[v.strip() for v in args.variants.split(",")] if args.variants else None)
