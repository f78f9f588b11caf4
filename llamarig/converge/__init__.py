"""What the deploy's stages share and decide: the host's plan and rig data and the managed state
read at once (`stage`), reboots (`boot`), module signing under Secure Boot (`secureboot`), and
which rig builds a build key and which get it shipped (`builds`)."""
