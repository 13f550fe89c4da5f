"""Which GPU architectures a torch release on PyPI ships, read from the wheel without downloading all of it.

    python tools/torch_wheel_archs.py 2.10.0 2.11.0

Reads the Linux x86_64 wheel for this Python through HTTP range requests: the zip directory, then only
torch/version.py and torch/lib/libtorch_python.so, whose arch list (what torch.cuda.get_arch_list() returns
on a GPU) is a string inside it. This is how requirements-volta.txt's pin was chosen.
"""

from __future__ import annotations

import io
import json
import re
import sys
import urllib.request
import zipfile

INDEX = "https://pypi.org/simple/torch/"


class RemoteFile(io.RawIOBase):
    """A read-only, seekable view of a URL, fetched in ranges."""

    def __init__(self, url: str):
        self.url, self.position = url, 0
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as response:
            self.size = int(response.headers["Content-Length"])

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.position

    def seek(self, offset, whence=0):
        self.position = {0: offset, 1: self.position + offset, 2: self.size + offset}[whence]
        return self.position

    def readinto(self, buffer):
        count = min(len(buffer), self.size - self.position)
        if count <= 0:
            return 0
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.position}-{self.position + count - 1}"})
        with urllib.request.urlopen(request, timeout=300) as response:
            data = response.read()
        buffer[:len(data)] = data
        self.position += len(data)
        return len(data)


def wheel_url(files: list[dict], version: str) -> str:
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for entry in files:
        name = entry["filename"]
        if name.startswith(f"torch-{version}-{tag}-{tag}-manylinux") and name.endswith("x86_64.whl"):
            return entry["url"]
    raise SystemExit(f"no Linux x86_64 wheel of torch {version} for {tag} on PyPI")


def main(versions: list[str]) -> int:
    request = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    files = json.load(urllib.request.urlopen(request, timeout=60))["files"]
    for version in versions:
        wheel = zipfile.ZipFile(io.BufferedReader(RemoteFile(wheel_url(files, version)), buffer_size=1 << 20))
        cuda = re.search(r"^cuda\b[^=]*=\s*'([\w.]+)'", wheel.read("torch/version.py").decode(), re.M)
        archs = re.findall(rb"sm_\d+(?: sm_\d+)+", wheel.read("torch/lib/libtorch_python.so"))
        print(f"torch {version}: CUDA {cuda.group(1) if cuda else '?'}: "
              f"{archs[0].decode() if archs else 'no CUDA arch list (CPU build?)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:] or ["2.10.0"]))
