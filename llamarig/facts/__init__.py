"""pyinfra facts llamarig reads from a host, one module per domain as `operations/` (gpu, driver,
files, server, build, apt, systemd); each is one shell command and a pure parser. `cache` reads
several in one round trip and answers again until something changes."""
