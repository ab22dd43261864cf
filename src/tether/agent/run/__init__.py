"""Running a task: the task model (`task`), the executor's step loop (`executor`), recovery from a failed
step (`recovery`), observation and confirmation rounds (`rounds`, `observe`, `confirm`), a person's replies
to questions (`replies`) and the final answer (`answer`)."""
