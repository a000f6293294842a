#!/usr/bin/env python3
"""A TCP relay between a head and a worker, standing where a stale or hijacked address
would: it forwards the handshake untouched, then injects a frame of its own towards the
worker, as anyone a node dials could (issue 16). Standard library only.

  relay.py TARGET_HOST:PORT --after-server-bytes N --inject-hex HEX

Prints `listening on HOST:PORT` once it listens; serves one connection, then exits.
The injection goes to the worker right after the first N bytes the worker sent have
reached the head (its Hello and Auth: the handshake), before anything more from the
head, so it lands between frames.
"""
import argparse
import socket
import sys
import threading


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("--after-server-bytes", type=int, required=True)
    parser.add_argument("--inject-hex", required=True)
    args = parser.parse_args()
    host, port = args.target.rsplit(":", 1)
    inject = bytes.fromhex(args.inject_hex)

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    print(f"listening on 127.0.0.1:{listener.getsockname()[1]}", flush=True)
    client, _ = listener.accept()
    server = socket.create_connection((host, int(port)))
    to_server = threading.Lock()

    def client_to_server():
        while True:
            data = client.recv(65536)
            if not data:
                break
            with to_server:
                server.sendall(data)
        server.shutdown(socket.SHUT_WR)

    def server_to_client():
        seen = 0
        injected = False
        while True:
            data = server.recv(65536)
            if not data:
                break
            if not injected and seen + len(data) >= args.after_server_bytes:
                # Hold the worker-bound direction: the head answers the last handshake
                # message at once, and the injection must reach the worker first.
                with to_server:
                    client.sendall(data)
                    server.sendall(inject)
                injected = True
            else:
                client.sendall(data)
            seen += len(data)
        client.shutdown(socket.SHUT_WR)

    def quietly(pipe):
        # A reset is how these connections end (the worker drops the tampered one).
        def run():
            try:
                pipe()
            except OSError:
                for sock in (client, server):
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
        return run

    threads = [threading.Thread(target=quietly(f)) for f in (client_to_server, server_to_client)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    sys.exit(main())
