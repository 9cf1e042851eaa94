"""``cachegen calibrate``: choose per-layer bins and codec options for quality targets and save
them as levels of the model's profile (``--codec tcq``: record the tcq levels that meet them)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cachegen.cli import options
from cachegen.errors import InputError

# calibrate's defaults of the flags that only cachegen levels take (tcq refuses them if changed)
LEVEL, EXACT_TOKENS, PROBE_GROUPS = 4, 1, 10
WINDOW_SIZES = ("windows", "context_tokens", "continuation_tokens")


def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc
    if not values:
        raise argparse.ArgumentTypeError("give at least one number")
    return values


def register(subparsers) -> None:
    p = options.command(
        subparsers,
        "calibrate",
        _calibrate,
        help="choose per-layer bins and codec options for a quality target; save them as a level",
        description="Measure each layer's sensitivity on the 'calibrate' split of the pydoc text, "
        "allocate bins and options for the fewest bits that keep the perplexity change within "
        "--target-ppl, verify on real runs and save the result as level --level of the model's "
        "cachegen profile. With --codec tcq: run every level of the model's tcq model on the "
        "same windows and record the cheapest level that meets each target (its loss for a "
        "quality bound; --set-default makes the first the tcq codec's default).",
    )
    p.add_argument(
        "--codec",
        choices=("cachegen", "tcq"),
        default="cachegen",
        help="the codec whose levels are calibrated" + options.DEFAULT,
    )
    options.model(p)
    p.add_argument(
        "--target-ppl",
        type=_float_list,
        default=[1.0],
        help="perplexity change targets in percent, comma-separated; one level each (default: 1)",
    )
    _window_arguments(p)
    _choice_arguments(p)
    p.add_argument(
        "--out", type=Path, help="also write calibration.json (all verified allocations) here"
    )
    options.json_flag(p, "print the result as JSON")
    options.no_progress(p)


def _window_arguments(p: argparse.ArgumentParser) -> None:
    """What is measured: the calibration windows and the probes."""
    margin = "aim at this fraction of the target on calibration windows"
    options.number(p, "--margin", 0.8, margin)
    options.integer(p, "--windows", 8, "calibration windows")
    options.integer(p, "--context-tokens", 1024, "tokens of context per window")
    options.integer(p, "--continuation-tokens", 64, "scored tokens per window")
    probes = "sensitivity probes per K/V: runs of consecutive layers"
    options.integer(p, "--probe-groups", PROBE_GROUPS, probes)
    options.seed(p, "window sampling seed")
    sink = "store the first N tokens of a sequence exactly, the attention sink"
    options.integer(p, "--exact-tokens", EXACT_TOKENS, sink)
    options.switch(
        p,
        "--no-derotate",
        "quantize keys as the model stores them (after RoPE) instead of turned back by "
        "their rotary angles",
    )


def _choice_arguments(p: argparse.ArgumentParser) -> None:
    """How the levels are chosen and saved."""
    first = "level number for the first target; further targets take the next numbers"
    options.integer(p, "--level", LEVEL, first)
    options.switch(p, "--set-default", "make the first target's level the model's default")
    options.switch(p, "--dry-run", "report the choice without saving a level")
    p.add_argument(
        "--select",
        choices=("kl", "ppl"),
        default="kl",
        help="how a target picks among verified allocations: kl = KL within the budget the "
        "target maps to (robust on few windows), ppl = measured perplexity change within margin "
        "x target" + options.DEFAULT,
    )
    p.add_argument(
        "--apply",
        type=Path,
        metavar="CALIBRATION_JSON",
        help="do not measure: save the levels of an earlier run's calibration.json (same model; "
        "with --codec tcq: record the choices of its tcq-calibration.json)",
    )
    p.add_argument(
        "--trials",
        type=Path,
        metavar="CALIBRATION_JSON",
        help="do not measure allocations: choose again (--target-ppl, --select, --margin) among "
        "those an earlier run verified, on its windows (with --codec tcq: among the levels of "
        "its tcq-calibration.json)",
    )


def _settings(args: argparse.Namespace, **cachegen_only):
    """The calibration settings of the arguments (``cachegen_only``: what tcq does not take)."""
    from cachegen_lab.quality.calibrate import CalibrationSettings

    return CalibrationSettings(
        targets=tuple(args.target_ppl),
        **options.values(args, "margin", "select", *WINDOW_SIZES, "seed"),
        **cachegen_only,
    )


def _calibrate(args: argparse.Namespace) -> int:
    from cachegen_lab.quality import report
    from cachegen_lab.quality.calibrate import calibrate, choose_again, save_level

    if args.apply and args.trials:
        raise InputError("--apply and --trials are alternatives: give one")
    if args.codec == "tcq":
        return _calibrate_tcq(args)
    if args.apply:
        return _apply(args)
    options.require_positive(args, *WINDOW_SIZES, "probe_groups")
    if not 0 <= args.exact_tokens <= 65535:
        raise InputError(f"--exact-tokens must be in 0..65535, got {args.exact_tokens}")
    settings = _settings(
        args,
        probe_groups=args.probe_groups,
        derotate_keys=not args.no_derotate,
        exact_tokens=args.exact_tokens,
    )
    progress = not args.no_progress
    if args.trials:
        result = choose_again(args.model, args.trials, settings, progress=progress)
    else:
        result = calibrate(args.model, settings, progress=progress)
    summary = result.to_dict()
    if not args.dry_run:
        for i, (choice, entry) in enumerate(zip(result.choices, summary["choices"])):
            entry["saved"] = save_level(
                args.model, choice.config, args.level + i, make_default=args.set_default and i == 0
            )
    if args.out:
        report.write_json(args.out / "calibration.json", summary)
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "trials"}, indent=2))
    else:
        _print_choices(result, summary)
    return 0


def _apply(args: argparse.Namespace) -> int:
    """Save the levels an earlier calibration chose."""
    from cachegen_lab.quality.calibrate import load_choices, save_level

    saved = [
        save_level(args.model, config, args.level + i, make_default=args.set_default and i == 0)
        for i, config in enumerate(load_choices(args.apply, args.model))
    ]
    if args.json:
        print(json.dumps(saved, indent=2))
    for entry in [] if args.json else saved:
        print(f"saved level {entry['level']} of {entry['profile']}" + _default(entry))
    return 0


def _default(saved: dict) -> str:
    return " (the default)" if saved["default"] else ""


def _print_choices(result, summary: dict) -> None:
    print(
        f"{len(result.trials)} allocations verified on {result.settings.windows} calibration "
        f"windows (aiming at {result.settings.margin:.0%} of each target)"
    )
    for entry in summary["choices"]:
        config = entry["config"]
        print(
            f"target |perplexity change| <= {entry['target_ppl_pct']:g}%: "
            f"hadamard={config['hadamard']} key_scale={config['key_scale']} "
            f"value_scale={config['value_scale']}"
        )
        print(f"  key bins   {config['key_bins']}")
        print(f"  value bins {config['value_bins']}")
        print(
            f"  {entry['codec_bits_per_element']:.3f} bits/element through the codec; "
            "on the calibration windows "
            f"perplexity {entry['ppl_change_pct']:+.2f}%, KL {entry['kl']:.4f}, "
            f"top-1 agreement {100 * entry['top1_agreement']:.1f}%"
        )
        if "saved" in entry:
            saved = entry["saved"]
            print(f"  saved as level {saved['level']} of {saved['profile']}" + _default(saved))


def _calibrate_tcq(args: argparse.Namespace) -> int:
    from cachegen_lab.quality import report
    from cachegen_lab.quality.tcq_calibrate import (
        calibrate_tcq,
        choose_tcq_again,
        read_calibration,
        save_choices,
        unmet,
    )

    cachegen_only = {
        "--no-derotate": args.no_derotate,
        "--level": args.level != LEVEL,
        "--exact-tokens": args.exact_tokens != EXACT_TOKENS,
        "--probe-groups": args.probe_groups != PROBE_GROUPS,
    }
    given = [flag for flag, value in cachegen_only.items() if value]
    if given:
        raise InputError(
            f"{', '.join(given)} calibrate cachegen levels; a tcq level's bits are fixed by its "
            "model file (drop them, or use --codec cachegen)"
        )
    if args.apply:
        saved = save_choices(
            args.model, read_calibration(args.apply), make_default=args.set_default
        )
        print(json.dumps(saved, indent=2) if args.json else f"recorded {saved}")
        return 0
    options.require_positive(args, *WINDOW_SIZES)
    settings = _settings(args)
    if args.trials:
        document = choose_tcq_again(args.model, args.trials, settings)
    else:
        document = calibrate_tcq(args.model, settings, progress=not args.no_progress)
    missed = unmet(document)
    status = 1 if len(missed) == len(document["choices"]) else 0
    if not args.dry_run and not status:  # nothing met: the earlier record stays as it was
        document["saved"] = save_choices(args.model, document, make_default=args.set_default)
    if args.out:
        report.write_json(args.out / "tcq-calibration.json", document)
    for choice in missed:
        print(f"warning: {choice['unmet']}", file=sys.stderr)
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        _print_tcq(document)
    return status


def _print_tcq(document: dict) -> None:
    print(
        f"tcq model {document['tcq_model']}: {len(document['trials'])} levels on "
        f"{document['windows']} calibration windows"
    )
    for t in document["trials"]:
        print(
            f"  level {t['level']}: {t['bits_per_element']:.3f} bits/element, perplexity "
            f"{t['ppl_change_pct']:+.2f}%, KL {t['kl']:.4f}, top-1 {100 * t['top1_agreement']:.1f}%"
        )
    for choice in document["choices"]:
        target = choice["target_ppl_pct"]
        print(f"target |perplexity change| <= {target:g}%: level {choice['level'] or 'none'}")
    if "saved" in document:
        default = document["saved"]["default_level"]
        print("recorded" + (f"; level {default} is the tcq default" if default else ""))
