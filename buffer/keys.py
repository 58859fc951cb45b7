"""CurveZMQ key files: the run's two key pairs on disk, and who may read them.

A key directory holds ``server.key`` / ``server.key_secret`` (the learner's pair) and
``client.key`` / ``client.key_secret`` (the pair every producer shares), in zmq.auth's
certificate format. Invariants:
- only the learner creates keys, on first use; a producer never does (a fresh pair would not
  match the learner's, and it could never connect);
- a new directory is 0700 and each secret file 0600 from the moment it exists (written in a
  private temporary directory, then moved into place);
- a secret file that other users can read or write is refused, as ssh refuses an unprotected
  private key: the key would no longer prove who holds it.
``buffer.transport`` takes the loaded ``CurveKeys`` and configures its sockets with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class CurveKeys:
    """CurveZMQ keys (Z85-encoded bytes, as zmq.curve_keypair / zmq.auth produce).

    The learner needs server_public + server_secret, and client_public to admit only producers
    holding the matching client_secret (without it, any client knowing server_public connects).
    Producers need server_public + client_public + client_secret.
    """

    server_public: bytes
    server_secret: bytes | None = None
    client_public: bytes | None = None
    client_secret: bytes | None = None


def generate_curve_keys(directory: str | Path) -> CurveKeys:
    """Load the server and client key pairs from ``directory``, creating them on first use
    (files server.key / server.key_secret / client.key / client.key_secret, via zmq.auth).

    A new directory is made 0700 and each secret key file 0600, written inside a private
    temporary directory and moved into place, so no other local user can ever read a secret
    (one who could would pose as the learner or as a producer)."""
    d = Path(directory)
    if not d.exists():
        d.mkdir(mode=0o700, parents=True)
        d.chmod(0o700)  # mkdir's mode is masked by the umask; this is not
    for name in ("server", "client"):
        if not (d / f"{name}.key_secret").exists():
            _create_key_pair(d, name)
    server_public, server_secret = _load_secret(d / "server.key_secret")
    client_public, client_secret = _load_secret(d / "client.key_secret")
    return CurveKeys(server_public, server_secret, client_public, client_secret)


def _create_key_pair(d: Path, name: str) -> None:
    import tempfile

    import zmq.auth

    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=d))  # 0700: private from the start
    try:
        public, secret = zmq.auth.create_certificates(tmp, name)
        Path(secret).chmod(0o600)
        Path(public).chmod(0o644)  # the public half is meant to be copied around
        Path(public).replace(d / f"{name}.key")
        Path(secret).replace(d / f"{name}.key_secret")
    finally:
        for leftover in tmp.iterdir():
            leftover.unlink()
        tmp.rmdir()


def check_secret_key_file(path: str | Path) -> None:
    """Refuse a secret key file that other users can read or write, as ssh does for a private
    key: the key would no longer prove who holds it. Raises PermissionError saying how to fix."""
    p = Path(path)
    st = p.stat()
    if st.st_mode & 0o077:
        raise PermissionError(
            f"secret key {p} is accessible by others (mode {st.st_mode & 0o777:04o}); it must "
            f"be readable by its owner only: chmod 600 {p}"
        )


def _load_secret(path: Path) -> tuple[bytes, bytes | None]:
    import zmq.auth

    check_secret_key_file(path)
    return zmq.auth.load_certificate(path)


def load_curve_keys(directory: str | Path, role: str) -> CurveKeys:
    """Keys for ``role`` ("learner": both pairs, created on first use; "producer": the server's
    public key and the client pair, which is all a producer node needs). A producer never
    creates keys: a fresh pair would not match the learner's, and it could never connect.
    A secret key file readable by other users is refused (check_secret_key_file)."""
    import zmq.auth

    if role == "learner":
        return generate_curve_keys(directory)
    d = Path(directory)
    need = [d / "server.key", d / "client.key_secret"]
    missing = [str(p) for p in need if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"CURVE keys missing: {', '.join(missing)}. Copy the learner's key directory "
            "(server.key, client.key, client.key_secret; server.key_secret is not needed) to "
            "this node"
        )
    server_public, _ = zmq.auth.load_certificate(d / "server.key")
    client_public, client_secret = _load_secret(d / "client.key_secret")
    return CurveKeys(server_public, None, client_public, client_secret)
