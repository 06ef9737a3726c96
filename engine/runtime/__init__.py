"""Engine processes: rank launch and supervision (launch.py, ranks.py), the launch checks, the rank loop and
its pipe protocol, the DP controller, and the clients that drive the ranks (client.py for serving,
offline.py for generation, node_ranks.py for nodes > 0)."""
