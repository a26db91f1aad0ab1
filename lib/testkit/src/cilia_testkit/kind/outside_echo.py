"""The echo service of the cluster's "outside" host (it stands for the internet): every
answer names the peer address the host saw, so a test can tell whether pod traffic was
masqueraded (it sees the node's address) or not (the pod's address, and the reply is lost:
this host has no route to any pod CIDR).

- HTTP on :data:`HTTP_PORT`: any GET answers ``200`` with body ``<peer ip> <peer port>\\n``;
- TCP on :data:`TCP_PORT`: writes ``<peer ip> <peer port>\\n`` and closes;
- UDP on :data:`UDP_PORT`: answers each datagram with ``<peer ip> <peer port>\\n``.

Runs with the base image's ``python3`` (standard library only): ``python3 outside_echo.py``.
"""

from __future__ import annotations

import http.server
import socket
import socketserver
import threading

HTTP_PORT = 8080
TCP_PORT = 9000
UDP_PORT = 9000


class _Http(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"{self.client_address[0]} {self.client_address[1]}\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args: object) -> None:
        print(f"http {self.client_address[0]}:{self.client_address[1]} {fmt % args}", flush=True)


class _Tcp(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        host, port = self.client_address[:2]
        print(f"tcp {host}:{port}", flush=True)
        self.request.sendall(f"{host} {port}\n".encode())


class _Udp(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        _data, sock = self.request
        host, port = self.client_address[:2]
        print(f"udp {host}:{port}", flush=True)
        sock.sendto(f"{host} {port}\n".encode(), self.client_address)


def main() -> None:
    """Serve the three echoes until killed."""
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    servers: list[socketserver.BaseServer] = [
        http.server.ThreadingHTTPServer(("0.0.0.0", HTTP_PORT), _Http),
        socketserver.ThreadingTCPServer(("0.0.0.0", TCP_PORT), _Tcp),
        socketserver.ThreadingUDPServer(("0.0.0.0", UDP_PORT), _Udp),
    ]
    for server in servers[1:]:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print(
        f"echo: http :{HTTP_PORT}, tcp :{TCP_PORT}, udp :{UDP_PORT} on {socket.gethostname()}",
        flush=True,
    )
    servers[0].serve_forever()


if __name__ == "__main__":
    main()
