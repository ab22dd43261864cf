"""Planning: the plan of skill calls (`plan`), references between steps (`refs`), and the planner that
turns a request into a validated plan (`planner`)."""
