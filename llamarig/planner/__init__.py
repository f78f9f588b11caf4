"""The planner: what is read before planning (`gather`, `header`), the plan of GPU memory and
context (`memory`, `plan`), what it renders for the host (`render`), and the probe that enrolls
a new box (`enroll`, `llamarig init`)."""
