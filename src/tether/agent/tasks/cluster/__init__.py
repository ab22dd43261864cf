"""Tasks on several servers: which server runs each unfinished task when they share one database (`ownership`,
its lease), and a cluster node's tasks as the other nodes follow and steer them (`peers`)."""
