"""The helpers the tests share, imported as `tests.kits.<name>`: aip (a scripted AIP device and an
in-process server), netutil (real `tether` processes, clusters, proxies), db (the per-test database of the
PostgreSQL pass), task and fanout (in-process agent servers), desktop (Xvfb), results, and the kits of the
attack, chaos, cluster, fuzz and gateway suites. What benches also use lives in bench/kit/."""
