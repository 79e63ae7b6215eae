"""`make image-test` refuses clearly where it cannot run, before it installs or starts anything."""

from __future__ import annotations

import subprocess

import pytest

from tests.image import __main__ as image_test
from tests.image.debian_base import extra_host_cas


def test_refuses_without_root(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(image_test.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(image_test, "ensure_packages", lambda: pytest.fail("installed as non-root"))
    assert image_test.main(["--cache", str(tmp_path)]) == 2
    assert "image-test: refused: needs root" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_refuses_when_docker_io_cannot_be_installed(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(image_test.os, "geteuid", lambda: 0)
    monkeypatch.setattr(image_test, "PACKAGES", {str(tmp_path / "no-dockerd"): "docker.io"})

    def apt(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 100, "", "E: Unable to locate package docker.io\n")

    monkeypatch.setattr(image_test.shutil, "which", lambda name: "/usr/bin/apt-get")
    monkeypatch.setattr(image_test.subprocess, "run", apt)
    assert image_test.main(["--cache", str(tmp_path / "cache")]) == 2
    out = capsys.readouterr().out
    assert "refused: cannot install docker.io (apt-get exit 100: E: Unable to locate package" in out
    assert not (tmp_path / "cache").exists()


def test_the_base_trusts_only_the_hosts_extra_certificates(tmp_path):
    def pem(body: str) -> str:
        return f"-----BEGIN CERTIFICATE-----\n{body}\n-----END CERTIFICATE-----"

    debian = tmp_path / "debian" / "mozilla"
    debian.mkdir(parents=True)
    (debian / "a.crt").write_text(pem("AAAA\nBBBB") + "\n")
    bundle = tmp_path / "bundle.crt"
    bundle.write_text(pem("AAAABBBB") + "\n" + pem("CCCC") + "\n")  # a's body wrapped differently
    assert extra_host_cas(bundle, tmp_path / "debian") == [pem("CCCC")]
    assert extra_host_cas(tmp_path / "missing.crt", tmp_path / "debian") == []


def test_refuses_a_cache_outside_the_checkout(monkeypatch, capsys, tmp_path):
    """Its wheel folder must be in the build context (found with IMAGE_CACHE elsewhere: a raw ValueError)."""
    monkeypatch.setattr(image_test.os, "geteuid", lambda: 0)
    monkeypatch.setattr(image_test, "ensure_packages", lambda: None)
    monkeypatch.setattr(image_test, "ensure_wheels", lambda *a: pytest.fail("downloaded before refusing"))
    assert image_test.main(["--cache", str(tmp_path / "cache")]) == 2
    assert "must be inside the checkout" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
