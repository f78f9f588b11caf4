"""Features of a rig that serves: paced checks beside users (`pace`), expected answers (`answers`),
what runs now (`status`), and measured tuning (`tune`, `throughput`)."""
