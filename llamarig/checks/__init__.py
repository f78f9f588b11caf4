"""The testinfra suite `llamarig verify` runs against a host (conftest.py, test_rig.py), shipped
inside the package so an installed llamarig carries it. Not part of the project's own tests."""
