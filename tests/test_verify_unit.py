"""`llamarig verify` glue: the ssh configuration it hands testinfra and the expectations file."""

from llamarig.config import load_inventory
from llamarig.verify import expectations, ssh_config
from tests.conftest import PROJECT


def test_ssh_config_checks_host_keys():
    text = ssh_config(
        "llamarig-rig1",
        {"host": "192.0.2.1", "port": 2200, "user": "root", "key": "/k", "known_hosts": "/kh"},
    )
    assert "Host llamarig-rig1\n  HostName 192.0.2.1\n  Port 2200\n" in text
    assert "StrictHostKeyChecking yes" in text and "UserKnownHostsFile /kh" in text
    assert "IdentityFile /k" in text and "BatchMode yes" in text


def test_expectations_carry_the_planned_data():
    host = load_inventory(PROJECT / "inventory" / "example-5080-3090.yml").hosts["rig1"]
    expected = expectations(host)
    assert expected["data"]["server"]["tensor_split"] == [2, 3]
    assert expected["derived"]["base_url"] == "http://127.0.0.1:8001"
    assert expected["derived"]["nvcc"] == "/usr/local/cuda-13.0/bin/nvcc"
    assert expected["derived"]["cmake_options"]["CMAKE_CUDA_ARCHITECTURES"] == "86-real;120a-real"
