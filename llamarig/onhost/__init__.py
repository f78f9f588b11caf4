"""What llamarig keeps on a host and how it talks to it: the paths (`hostpaths`), the records it
reads back (`checksums`, `deploy_record`, `driver_build`), detached jobs and their progress
(`hostjob`, `progress`), and the bounds of every HTTP request (`httpbounds`)."""
