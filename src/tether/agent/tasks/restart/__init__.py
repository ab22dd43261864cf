"""What a restarted server (or one taking over a stopped server's task) does with an unfinished task: a list
plan's step in flight and the question it may raise (`plans`), a graph's steps in flight and the device a
step is given (`graphs`)."""
