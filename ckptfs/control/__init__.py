"""The control socket and what it answers: the client side and Python API (client.py), the socket
(server.py), the answers (answers.py), status gathered once (status.py) and the Prometheus metrics
(metrics.py)."""
