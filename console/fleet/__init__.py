"""The fleet: every host of a service in one console, reached with the system `ssh` (`spec`: the
hosts and how to reach them; `ssh`: the command lines and what a failure means; `collector`: each
host's snapshot, streamed; `rows`: a host's row and the toolchain drift between hosts;
`actions`: what runs on many hosts). Torch-free, like the rest of the console."""
