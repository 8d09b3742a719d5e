"""A checkpoint into an S3-compatible store: torch DCP written locally then uploaded (`asyncrl.remote`, what the
learner ranks do) against DCP's own `FsspecWriter` straight to the store, and back (download + load against
`FsspecReader`). The store is moto's standalone server on 127.0.0.1 (test extra `moto[server]`), so the times are
the client's and the server's CPU cost on this machine, not a network's.

    python benchmarks/storage_checkpoint.py [--mb 64 128] [--repeats 3]

Writes benchmarks/results/storage_checkpoint.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _state(mb: int) -> dict[str, torch.Tensor]:
    """`mb` MiB of fp32 tensors in 16 parameters (a small model's state dict)."""
    n = mb * (1 << 20) // 4 // 16
    return {f"layer{i}.weight": torch.randn(n) for i in range(16)}


def _timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def main() -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from asyncrl.remote import Store, join
    from asyncrl.testing import S3_TEST_ENV, S3Server

    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.update(S3_TEST_ENV)
    os.environ["AWS_ENDPOINT_URL"] = ""  # set below, once the server has its port
    server = S3Server()
    os.environ["AWS_ENDPOINT_URL"] = server.endpoint_url  # FsspecWriter's s3fs finds the endpoint here
    store = Store(server.endpoint_url)
    rows = []
    try:
        for mb in args.mb:
            state = _state(mb)
            times: dict[str, list[float]] = {k: [] for k in ("local_save", "upload", "fsspec_save", "download_load", "fsspec_load")}
            for r in range(args.repeats):
                with tempfile.TemporaryDirectory() as tmp:
                    local, uri, direct = Path(tmp) / "ckpt", server.uri(f"b{mb}-{r}", "staged"), server.uri(f"b{mb}-{r}", "direct")
                    times["local_save"].append(_timed(lambda: dcp.save(state, checkpoint_id=str(local))))
                    times["upload"].append(_timed(lambda: store.upload(local, uri)))
                    times["fsspec_save"].append(_timed(lambda: dcp.save(state, storage_writer=FsspecWriter(direct, endpoint_url=server.endpoint_url))))
                    target = {k: torch.empty_like(v) for k, v in state.items()}

                    def download_load() -> None:
                        back = store.download(uri, Path(tmp) / "back")
                        dcp.load(target, checkpoint_id=str(back))
                        shutil.rmtree(back)

                    times["download_load"].append(_timed(download_load))
                    times["fsspec_load"].append(_timed(lambda: dcp.load(target, storage_reader=FsspecReader(direct, endpoint_url=server.endpoint_url))))
                    assert all(torch.equal(target[k], state[k]) for k in state)
            median = {k: round(statistics.median(v), 3) for k, v in times.items()}
            rows.append({"mb": mb, "repeats": args.repeats, "median_s": median, "all_s": times})
            print(json.dumps({"mb": mb, **median}), flush=True)
    finally:
        server.stop()
    out = Path(__file__).parent / "results" / "storage_checkpoint.json"
    out.write_text(json.dumps({"benchmark": "storage_checkpoint", "load_average": os.getloadavg(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
