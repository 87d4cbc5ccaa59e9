"""Take the measured rates out of a hardware file ``npu-inject calibrate`` wrote, into the packaged catalog's
form: ``npu_inject/hardware_rates/<profile>.json``, which a profile of ``npu_inject/hardware.json`` names as
its ``rates``. One point per line, so a new calibration's diff reads point by point.

    python tools/package_rates.py calibrated-H100-SXM.json H100-SXM npu_inject/hardware_rates/H100-SXM.json
    python tools/package_rates.py --grouped-only calibrated-H200.json H200 npu_inject/hardware_rates/H200.json

``--grouped-only`` replaces the grouped matmul points (``matmul`` points with ``groups``) of the existing
rates file with the calibration's and keeps every other point as it is.
"""

from __future__ import annotations

import argparse
import json


def write_rates(rates: dict, path: str) -> None:
    lines = ["{"]
    entries = list(rates.items())
    for index, (key, value) in enumerate(entries):
        comma = "," if index < len(entries) - 1 else ""
        if isinstance(value, list):
            lines.append(f"  {json.dumps(key)}: [")
            lines += [f"    {json.dumps(point)}{',' if i < len(value) - 1 else ''}" for i, point in enumerate(value)]
            lines.append(f"  ]{comma}")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}{comma}")
    lines.append("}")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("calibrated", help="the hardware file npu-inject calibrate wrote")
    parser.add_argument("profile", help="the profile in it")
    parser.add_argument("output", help="the rates file to write")
    parser.add_argument("--grouped-only", action="store_true",
                        help="replace only the output's grouped matmul points with the calibration's")
    args = parser.parse_args()
    with open(args.calibrated, encoding="utf-8") as handle:
        rates = json.load(handle)["profiles"][args.profile]["rates"]
    if args.grouped_only:
        with open(args.output, encoding="utf-8") as handle:
            kept = json.load(handle)
        grouped = [point for point in rates["matmul"] if "groups" in point]
        if not grouped:
            raise SystemExit(f"{args.calibrated}: profile {args.profile} has no grouped matmul points")
        kept["matmul"] = [point for point in kept["matmul"] if "groups" not in point] + grouped
        rates = kept
    write_rates(rates, args.output)


if __name__ == "__main__":
    main()
