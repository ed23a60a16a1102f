"""Run transformers' own model tests on models patched by hf_posenc, and diff against the baseline.

For every family (llama, mistral, gpt2) and every encoding (plus ``baseline``, no patch) this
runs ``tests/models/<family>/test_modeling_<family>.py`` of a transformers checkout with the
``hf_posenc_patch_plugin`` loaded, writes a junit xml and the raw log, then prints a table of
passed/failed/skipped/errors and the tests that fail patched but pass in the baseline,
grouped by cause (exception type, first line of the message, the hf_posenc frame it came from).

    python tests/external/run_transformers_suite.py --checkout /path/to/transformers \\
        --out /tmp/acceptance --families llama --encodings baseline,rope,alibi

``--summarize-only`` rebuilds the summary from the xml files already in ``--out``. Runs whose
xml already exists are skipped unless ``--force``. See README.md in this folder.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
FAMILIES = ("llama", "mistral", "gpt2")
ENCODINGS = ("baseline", "rope", "alibi", "t5", "expe", "fire", "fox", "tape")
#: the distributed mixins start worker processes (gloo on CPU); they test sharding, not positions
DEFAULT_MARKERS = "not is_tensor_parallel_test and not is_fsdp_test"
#: label suffix of runs with HF_POSENC_ON_PATCH_ERROR=skip (models the engine refuses stay unpatched)
LENIENT = "+lenient"
FRAME = re.compile(r"^(?P<path>\S+?\.py):(?P<line>\d+): in (?P<func>\S+)")
#: frames quoted inside a message (torch.compile's user stack): 'File "x.py", line N, in f'
QUOTED_FRAME = re.compile(r'^(?:E\s+)?File "(?P<path>[^"]+?\.py)", line (?P<line>\d+), in (?P<func>\S+)')


def test_file(checkout: Path, family: str) -> Path:
    return checkout / "tests" / "models" / family / f"test_modeling_{family}.py"


def run_one(args: argparse.Namespace, family: str, encoding: str) -> None:
    out = Path(args.out)
    label = encoding
    if encoding != "baseline":
        label += LENIENT if args.on_patch_error == "skip" else ""
        label += "+after" if args.from_pretrained == "after" else ""
    xml = out / "junit" / f"{family}__{label}.xml"
    log = out / "raw" / f"{family}__{label}.log"
    if xml.exists() and not args.force:
        print(f"[skip] {family} x {label}: {xml} exists (use --force to rerun)", flush=True)
        return
    xml.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["HF_POSENC_ENCODING"] = "" if encoding == "baseline" else encoding
    if args.from_pretrained:
        env["HF_POSENC_FROM_PRETRAINED"] = args.from_pretrained
    env["HF_POSENC_ON_PATCH_ERROR"] = args.on_patch_error
    if not args.online:
        # tests that want a hub tokenizer or tiny model skip at once instead of after network timeouts
        env["HF_HUB_OFFLINE"] = "1"
    # --engine: a folder holding an hf_posenc package (e.g. `git archive HEAD hf_posenc`), put
    # ahead of the installed one so every run of the matrix tests the same engine
    paths = (args.engine or "", str(HERE), env.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-p",
        "hf_posenc_patch_plugin",
        "-q",
        "-rA",
        "--tb=short",
        "-o",
        "log_cli=false",
        "-o",
        "junit_family=xunit2",
        f"--junitxml={xml}",
        "-m",
        args.markers,
        f"--timeout={args.timeout}",
    ]
    if args.k:
        cmd += ["-k", args.k]
    if args.jobs > 1:
        cmd += ["-n", str(args.jobs)]
    cmd.append(str(test_file(Path(args.checkout), family).relative_to(args.checkout)))
    print(f"[run ] {family} x {label}: {' '.join(cmd[2:])}", flush=True)
    start = time.time()
    with open(log, "w") as f:
        f.write(
            f"# cwd={args.checkout} HF_POSENC_ENCODING={env['HF_POSENC_ENCODING']!r}\n# {' '.join(cmd)}\n"
        )
        f.flush()
        rc = subprocess.call(cmd, cwd=args.checkout, env=env, stdout=f, stderr=subprocess.STDOUT)
        f.write(f"\n# exit status {rc}, {time.time() - start:.0f} s\n")
    print(f"[done] {family} x {label}: exit {rc} in {time.time() - start:.0f} s", flush=True)


def describe_environment(checkout: str | None, engine: str | None) -> str:
    """One paragraph for the summary: the checkout's version vs the installed transformers, the engine."""
    import importlib.metadata

    parts = [f"installed transformers {importlib.metadata.version('transformers')}"]
    if checkout:
        init = Path(checkout) / "src" / "transformers" / "__init__.py"
        version = re.search(r'__version__ = "([^"]+)"', init.read_text()) if init.exists() else None
        parts.append(
            f"checkout {checkout} (its src/transformers says {version[1] if version else 'unknown'})"
        )
        head = subprocess.run(
            ["git", "-C", checkout, "log", "-1", "--format=%H %ci"],
            capture_output=True,
            text=True,
            check=False,
        )
        if head.returncode == 0:
            parts.append(f"checkout commit {head.stdout.strip()}")
    if engine:
        commit = Path(engine) / "COMMIT"
        parts.append(
            f"engine {engine}"
            + (f" (hf_posenc commit {commit.read_text().strip()})" if commit.exists() else "")
        )
    else:
        parts.append("engine: the installed hf_posenc (its working tree at run time)")
    return "Environment: " + "; ".join(parts) + "."


# --------------------------------------------------------------------------- parsing


def parse(xml: Path) -> dict[str, dict]:
    """test id -> {"outcome": passed|failed|error|skipped, "message", "text"}."""
    results: dict[str, dict] = {}
    root = ET.parse(xml).getroot()
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message, text = "passed", "", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = child.get("message", "") or ""
                text = child.text or ""
                if outcome != "skipped":
                    break
        if name in results and results[name]["outcome"] in ("failed", "error"):
            continue  # keep a call failure over a teardown record of the same test
        results[name] = {"outcome": outcome, "message": message, "text": text}
    return results


def short_name(test_id: str) -> str:
    classname, _, name = test_id.partition("::")
    return f"{classname.rsplit('.', 1)[-1]}::{name}"


def first_line(message: str) -> str:
    for line in message.splitlines():
        if line.strip():
            return line.strip()
    return ""


def normalise(line: str) -> str:
    line = re.sub(r"0x[0-9a-f]+", "0x…", line)
    line = re.sub(r"/tmp/[^\s'\"]+", "/tmp/…", line)
    line = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", line)
    return line[:200]


def short_path(path: str) -> str:
    for anchor in ("hf_posenc/", "site-packages/", "tests/"):
        if anchor in path:
            return path[path.rindex(anchor) :].removeprefix("site-packages/")
    return path


def posenc_frame(text: str) -> str:
    """The innermost traceback frame inside hf_posenc ('hf_posenc/x.py:LINE in func'), or, when
    there is none, '(no hf_posenc frame) <innermost frame>'."""
    found = innermost = ""
    for line in text.splitlines():
        m = FRAME.match(line.strip()) or QUOTED_FRAME.match(line.strip())
        if not m or "tests/external" in m["path"]:
            continue
        where = f"{short_path(m['path'])}:{m['line']} in {m['func']}"
        innermost = where
        if "hf_posenc" in m["path"]:
            found = where
    return found or (f"(no hf_posenc frame) {innermost}" if innermost else "")


def excerpt(text: str, width: int = 12) -> str:
    """The last traceback lines, starting at the innermost hf_posenc frame when there is one."""
    lines = [line for line in text.splitlines() if line.strip()]
    start = None
    for i, line in enumerate(lines):
        m = FRAME.match(line.strip()) or QUOTED_FRAME.match(line.strip())
        if m and "hf_posenc" in m["path"] and "tests/external" not in m["path"]:
            start = i
    if start is None:
        start = max(0, len(lines) - width)
    return "\n".join(lines[start : start + width])


def cause(result: dict) -> tuple[str, str]:
    message = first_line(result["message"]) or first_line(
        result["text"].splitlines()[-1] if result["text"] else ""
    )
    return normalise(message), posenc_frame(result["text"])


# --------------------------------------------------------------------------- summary


def summarize(out: Path, checkout_note: str) -> str:
    runs: dict[tuple[str, str], dict[str, dict]] = {}
    for xml in sorted((out / "junit").glob("*__*.xml")):
        family, encoding = xml.stem.split("__", 1)
        try:
            runs[(family, encoding)] = parse(xml)
        except ET.ParseError as e:
            print(f"warning: {xml}: {e}", file=sys.stderr)
    families = [f for f in FAMILIES if any(k[0] == f for k in runs)] + sorted(
        {k[0] for k in runs} - set(FAMILIES)
    )
    known = [e for e in ENCODINGS] + [e + LENIENT for e in ENCODINGS]
    encodings = [e for e in known if any(k[1] == e for k in runs)] + sorted({k[1] for k in runs} - set(known))

    lines = [
        "# hf_posenc acceptance: transformers' own model tests, patched vs baseline",
        "",
        f"Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC from {out / 'junit'}.",
    ]
    if checkout_note:
        lines += ["", checkout_note]
    notes = out / "notes.md"
    if notes.exists():  # hand-written reading of the results, kept across regenerations
        lines += ["", notes.read_text().strip()]
    lines += [
        "",
        "## Counts",
        "",
        "passed / failed / skipped / errors, one count per test (junit testcase; pytest's own line also counts "
        "subtests); **new** = tests that fail or error patched but pass in the baseline of the same family "
        "(+N: and N more that the baseline skips, listed with the groups below). "
        f"`<encoding>{LENIENT}`: models the engine refuses to patch are left unpatched "
        "(HF_POSENC_ON_PATCH_ERROR=skip), so failures behind a refusal show.",
        "",
        "| family | encoding | passed | failed | skipped | errors | new |",
        "|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str, str], list[tuple[str, str, str, dict]]] = collections.defaultdict(list)
    skipped_in_baseline: list[tuple[str, str, str]] = []
    for family in families:
        base = runs.get((family, "baseline"))
        for encoding in encodings:
            res = runs.get((family, encoding))
            if res is None:
                continue
            counts = collections.Counter(r["outcome"] for r in res.values())
            new = "—"
            if base is not None and encoding != "baseline":
                n = 0
                for test_id, r in res.items():
                    if r["outcome"] not in ("failed", "error"):
                        continue
                    b = base.get(test_id, {}).get("outcome")
                    if b == "passed":
                        n += 1
                        message, frame = cause(r)
                        key = (
                            message.split(":", 1)[0] if ":" in message else "AssertionError",
                            message,
                            frame,
                        )
                        groups[key].append((family, encoding, test_id, r))
                    elif b == "skipped" or b is None:
                        skipped_in_baseline.append((family, encoding, test_id))
                extra = sum(1 for f, e, _ in skipped_in_baseline if (f, e) == (family, encoding))
                new = f"{n} (+{extra})" if extra else str(n)
            lines.append(
                f"| {family} | {encoding} | {counts['passed']} | {counts['failed']} | {counts['skipped']} "
                f"| {counts['error']} | {new} |"
            )

    lines += ["", "## Failures patched but not in the baseline, grouped by cause", ""]
    if not groups:
        lines.append("None (or no baseline to compare with yet).")
    ordered = sorted(groups.items(), key=lambda kv: (-len({t for _, _, t, _ in kv[1]}), kv[0]))
    for number, ((_kind, message, frame), members) in enumerate(ordered, 1):
        tests = collections.defaultdict(set)
        baseline_skips = {(f, e, t) for f, e, t in skipped_in_baseline}
        for family, encoding, test_id, _ in members:
            mark = " [skipped in baseline]" if (family, encoding, test_id) in baseline_skips else ""
            tests[short_name(test_id) + mark].add(f"{family}/{encoding}")
        where = sorted({f"{f}/{e}" for f, e, _, _ in members})
        lines += [
            f"### {number}. `{message or '(no message)'}`",
            "",
            f"- where: {frame or '(no traceback)'}",
            f"- {len(members)} failures, {len(tests)} distinct tests; runs: {', '.join(where)}",
            "- tests:",
        ]
        for test in sorted(tests):
            runs_of_test = sorted(tests[test])
            suffix = "" if runs_of_test == where else f" ({', '.join(runs_of_test)})"
            lines.append(f"  - `{test}`{suffix}")
        sample = members[0][3]
        lines += [
            "- traceback excerpt (first failure):",
            "",
            "```",
            excerpt(sample["text"]),
            "```",
            "",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkout",
        default=os.environ.get("TRANSFORMERS_CHECKOUT"),
        help="transformers source checkout holding tests/ (default: $TRANSFORMERS_CHECKOUT)",
    )
    parser.add_argument("--out", default="/tmp/acceptance", help="folder for junit/, raw/ and summary.md")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--encodings", default=",".join(ENCODINGS), help="'baseline' is the unpatched run")
    parser.add_argument(
        "--markers", default=DEFAULT_MARKERS, help=f"pytest -m expression (default: {DEFAULT_MARKERS!r})"
    )
    parser.add_argument("-k", default="", help="pytest -k expression, to run a subset")
    parser.add_argument(
        "--timeout", type=int, default=600, help="per-test timeout in seconds (pytest-timeout)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="pytest-xdist workers per run (default 1)")
    parser.add_argument(
        "--from-pretrained",
        choices=("construct", "after"),
        default=None,
        help="HF_POSENC_FROM_PRETRAINED for the plugin; 'after' cells are labelled '<encoding>+after'",
    )
    parser.add_argument(
        "--engine",
        default=None,
        help="folder holding the hf_posenc package to test, put first on PYTHONPATH (default: the installed one)",
    )
    parser.add_argument(
        "--on-patch-error",
        choices=("raise", "skip"),
        default="raise",
        help=f"skip: models the engine refuses stay unpatched (cells labelled '<encoding>{LENIENT}')",
    )
    parser.add_argument(
        "--online",
        action="store_true",
        help="let tests reach the hub (default: HF_HUB_OFFLINE=1, hub-only tests skip at once)",
    )
    parser.add_argument("--force", action="store_true", help="rerun even when the xml exists")
    parser.add_argument("--summarize-only", action="store_true")
    parser.add_argument("--note", default="", help="a line for the summary (e.g. which transformers commit)")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env_file = out / "environment.txt"
    if not args.summarize_only:
        env_file.write_text(describe_environment(args.checkout, args.engine) + "\n")
    note = "\n\n".join(x for x in (args.note, env_file.read_text().strip() if env_file.exists() else "") if x)
    if not args.summarize_only:
        if not args.checkout:
            parser.error("--checkout (or $TRANSFORMERS_CHECKOUT) is required")
        args.checkout = str(Path(args.checkout).resolve())
        for family in args.families.split(","):
            if not test_file(Path(args.checkout), family).exists():
                parser.error(f"{test_file(Path(args.checkout), family)} does not exist")
        for family in args.families.split(","):
            for encoding in args.encodings.split(","):
                run_one(args, family, encoding)
                (out / "summary.md").write_text(summarize(out, note))
    summary = summarize(out, note)
    (out / "summary.md").write_text(summary)
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
