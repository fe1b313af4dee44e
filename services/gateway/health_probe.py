"""The Ray containers' readiness probe when the APIs serve TLS: `python -m
baton.services.gateway.health_probe`.

KubeRay gives every RayService worker a readiness probe that fetches the raylet's health and
then `http://localhost:<serve port>/-/healthz` in plaintext with wget; once Serve's proxy
speaks TLS that second fetch fails forever and the pod never receives traffic. The chart
replaces the probe (KubeRay keeps a probe the pod already has) with this one, which checks
the same two things: the raylet answers `success`, and Serve's proxy answers its health
route over HTTPS. The probe talks to its own pod, so it does not verify the server's
certificate (it checks health, not identity); under mTLS it presents the pod's serving
certificate and key as its client certificate, which the client CA must have signed.

Exit status 0: ready; 1: not, with the reason on stderr (kubelet records it in the event).
"""

from __future__ import annotations

import argparse
import ssl
import sys
import urllib.error
import urllib.request

RAYLET_HEALTH = "http://localhost:{port}/api/local_raylet_healthz"
SERVE_HEALTH = "https://localhost:{port}/-/healthz"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-port", type=int, required=True, help="Serve's HTTP (TLS) port")
    parser.add_argument(
        "--raylet-port", type=int, default=52365, help="the dashboard agent's port (Ray's default; 0: not checked)"
    )
    parser.add_argument("--cert-file", help="client certificate to present (mTLS)")
    parser.add_argument("--key-file", help="its private key")
    parser.add_argument("--timeout-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    if (args.cert_file is None) != (args.key_file is None):
        parser.error("--cert-file and --key-file go together")
    try:
        if args.raylet_port:
            _expect_success(RAYLET_HEALTH.format(port=args.raylet_port), None, args.timeout_s)
        _expect_success(SERVE_HEALTH.format(port=args.serve_port), _context(args), args.timeout_s)
    except ProbeFailed as failure:
        print(f"not ready: {failure}", file=sys.stderr)
        return 1
    return 0


class ProbeFailed(Exception):
    pass


def _context(args: argparse.Namespace) -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if args.cert_file is not None:
        try:
            context.load_cert_chain(args.cert_file, args.key_file)
        except (OSError, ssl.SSLError) as e:
            raise SystemExit(f"not ready: cannot load the client certificate {args.cert_file}: {e}") from e
    return context


def _expect_success(url: str, context: ssl.SSLContext | None, timeout_s: float) -> None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as response:
            body = response.read(4096).decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        raise ProbeFailed(f"{url} answered {e.code}") from e
    except (urllib.error.URLError, OSError, ssl.SSLError) as e:
        raise ProbeFailed(f"{url}: {getattr(e, 'reason', e)}") from e
    if "success" not in body:
        raise ProbeFailed(f"{url} answered {body[:200]!r}, not success")


if __name__ == "__main__":
    sys.exit(main())
