"""The local base image: a Debian root made with ``debootstrap``, kept as a tarball, imported into Docker.

No registry image can be pulled here, so ``BASE_IMAGE`` is built from Debian's own packages:
``debootstrap --variant=minbase bookworm`` (Debian 12, Python 3.11 like the local torch wheel), with the
package lists and caches removed, no host name or resolver of the machine that made it, the Debian
sources of a ``debian:bookworm`` image (main, updates, security), and the CA certificates this machine
trusts beyond Debian's own (``/etc/ssl/certs/ca-certificates.crt`` minus ``/usr/share/ca-certificates``:
a site's TLS-inspecting proxy, say) in ``/usr/local/share/ca-certificates``, which the image's
``ca-certificates`` package then adds to its trust store, so that pip in the build trusts what the host
trusts. The tarball is written once (temporary name, then rename) and reused; ``docker import`` turns
it into the image ``TAG`` when the daemon does not have it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from tests.image.dockerd import DockerdError, PrivateDockerd

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
TAG = "dpgs-base:bookworm"
HOST_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
DEBIAN_CAS = Path("/usr/share/ca-certificates")
SOURCES = f"""Types: deb
URIs: {MIRROR}
Suites: {SUITE} {SUITE}-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: {SUITE}-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""
_PEM = re.compile(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", re.S)


def _pems(text: str) -> list[str]:
    return _PEM.findall(text)


def extra_host_cas(bundle: Path = HOST_BUNDLE, debian: Path = DEBIAN_CAS) -> list[str]:
    """PEM certificates of ``bundle`` that are not among Debian's (compared without white space)."""
    if not bundle.is_file():
        return []
    known = set()
    for path in debian.rglob("*.crt") if debian.is_dir() else []:
        known.update("".join(p.split()) for p in _pems(path.read_text(errors="replace")))
    return [p for p in _pems(bundle.read_text(errors="replace")) if "".join(p.split()) not in known]


def tidy_root(root: Path, cas: list[str]) -> None:
    """Strip what debootstrap left of this machine and its downloads; add the sources and the CAs."""
    for sub in ("var/cache/apt", "var/lib/apt/lists"):
        for child in (root / sub).glob("*"):
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    (root / "etc/hostname").unlink(missing_ok=True)
    (root / "etc/resolv.conf").write_text("")
    (root / "etc/apt/sources.list").unlink(missing_ok=True)
    (root / "etc/apt/sources.list.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/apt/sources.list.d/debian.sources").write_text(SOURCES)
    ca_dir = root / "usr/local/share/ca-certificates"
    ca_dir.mkdir(parents=True, exist_ok=True)
    for k, pem in enumerate(cas):
        (ca_dir / f"host-extra-{k}.crt").write_text(pem + "\n")


def make_tarball(tarball: Path, log: Path) -> Path:
    """``tarball``: the tidied minbase root of :data:`SUITE` (debootstrap runs only when it is missing)."""
    if tarball.is_file():
        return tarball
    tarball.parent.mkdir(parents=True, exist_ok=True)
    root = tarball.parent / "root.tmp"
    shutil.rmtree(root, ignore_errors=True)
    try:
        with log.open("w") as fh:
            proc = subprocess.run(["debootstrap", "--variant=minbase", SUITE, str(root), MIRROR],
                                  stdout=fh, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-5:])
            raise DockerdError(f"debootstrap {SUITE} failed (exit {proc.returncode}, log {log}):\n{tail}")
        tidy_root(root, extra_host_cas())
        tmp = tarball.with_suffix(".tmp")
        subprocess.run(["tar", "--numeric-owner", "--xattrs", "-C", str(root), "-cf", str(tmp), "."],
                       check=True)
        os.replace(tmp, tarball)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return tarball


def ensure_base_image(daemon: PrivateDockerd, tarball: Path, log: Path) -> tuple[str, str]:
    """(:data:`TAG`, how it was had): present in ``daemon``, else imported from ``tarball`` (made first
    by debootstrap when missing)."""
    if daemon.docker("image", "inspect", TAG, check=False).returncode == 0:
        return TAG, "cached"
    how = "imported from the cached root" if tarball.is_file() else "debootstrap, then imported"
    make_tarball(tarball, log)
    daemon.docker("import", "--change", 'CMD ["bash"]', str(tarball), TAG)
    return TAG, how
