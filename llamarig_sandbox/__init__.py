"""The sandbox rig beside llamarig: a systemd-nspawn Debian box to converge (`sandbox`, its
command line, over `roots`, `containers`, `sshaccess`, `services` and `layout`), a tiny llama
model to serve (`testmodel`) and a file server standing in for a model hub (`fileserver`).
It uses llamarig; llamarig loads it only for `llamarig sandbox ...`."""
