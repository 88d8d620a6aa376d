"""What the tests share, and nothing else: paths, tiny models, input builders, a real local Ray
head, and the oracles the exactness tests compare against. Test modules import from here (or take
fixtures from ``tests/conftest.py``), never from one another."""
