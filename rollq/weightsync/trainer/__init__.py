"""Weight sync in the trainer's process: the publisher of versions (:mod:`.publisher`), the
broadcast sender as rank 0 (:mod:`.sender`) and its group's membership (:mod:`.group`), and
the ranks of a trainer with parameter shards (:mod:`.param_shards`)."""
