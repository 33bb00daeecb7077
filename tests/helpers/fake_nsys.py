"""A stand-in for `nsys` in CPU tests: it behaves like nsys at the file level, nothing more.

  profile --help: lists the options of an nsys without --cpuctxsw.
  profile: records its argv, runs a `--` application (except lmsys's own target, whose result file it
           writes as a finished run would), then writes OUTPUT.nsys-rep, or only OUTPUT.qdstrm
           (FAKE_NSYS_MODE=qdstrm, printing FAKE_NSYS_QDSTRM_TEXT's content as the importer's error), or,
           with FAKE_NSYS_MODE=hang, half an OUTPUT.nsys-rep and then waits (to be interrupted).
  stats:   copies FAKE_NSYS_FIXTURES/<report>.csv to BASE_<report>.csv, as `nsys stats --output BASE`
           names its files; a report without a fixture is SKIPPED, as nsys does for empty reports.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


def _opt(args, name):
    for a in args:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return None


def main(args):
    log = os.environ.get("FAKE_NSYS_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(args) + "\n")
    if args[:1] == ["--version"]:
        print("NVIDIA Nsight Systems version 2025.3.1.90-fake")
        return 0
    if args == ["profile", "--help"]:  # an nsys without --cpuctxsw, so that the caller drops it
        print("usage: nsys profile [<args>] [application] [<application args>]\n"
              "  --trace=  --output=  --force-overwrite=  --stats=  --sample=  --capture-range=  --capture-range-end=")
        return 0
    if args[:1] == ["profile"]:
        rest = args[1:]
        i = next(k for k, a in enumerate(rest) if not a.startswith("--"))
        app = rest[i:]
        output = _opt(rest[:i], "output")
        if "lmsys.profiling.nsys_target" in app:
            spec = json.loads(Path(app[-1]).read_text())
            Path(spec["result"]).write_text(json.dumps({"status": "ok"}))
            rc = 0
        else:
            rc = subprocess.run(app).returncode
        if os.environ.get("FAKE_NSYS_MODE") == "hang":
            Path(output + ".nsys-rep").write_bytes(b"NSYS-REP, partial")
            import time

            time.sleep(120)
            return 1
        if os.environ.get("FAKE_NSYS_MODE") == "qdstrm":
            Path(output + ".qdstrm").write_bytes(b"QDSTRM")
            text_file = os.environ.get("FAKE_NSYS_QDSTRM_TEXT")
            print(Path(text_file).read_text() if text_file else "Importer error status: Importation failed.")
            return rc
        Path(output + ".nsys-rep").write_bytes(b"NSYS-REP")
        print(f"Generated:\n    {output}.nsys-rep")
        return rc
    if args[:1] == ["stats"]:
        base = _opt(args, "output")
        fixtures = Path(os.environ["FAKE_NSYS_FIXTURES"])
        for a in args:
            if a.startswith("--report="):
                report = a.split("=", 1)[1]
                src = fixtures / f"{report}.csv"
                if src.is_file():
                    shutil.copy(src, f"{base}_{report}.csv")
                else:
                    print(f"SKIPPED: {args[-1]} does not contain data for {report}.")
        return 0
    print(f"fake nsys: unknown command {args}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
