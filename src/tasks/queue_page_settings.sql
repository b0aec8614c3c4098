-- queue_page_settings.sql: the planner settings queue_page.sql is read under, in its own
-- read-only transaction (the resource queues' loads and catch-ups). With statistics from before
-- a burst of tasks, its generic plan otherwise bitmapped Pulp's state index and sorted every task
-- after the position, for each page. Without bitmaps and full sorts, each branch walks its range
-- of the (state, pulp_created) index in order and stops after a page. The generic plan is built
-- under these at its first execution on each connection, and kept.
-- Never writes; changes nothing after the transaction ends (SET LOCAL).
SET LOCAL enable_bitmapscan = off;
SET LOCAL enable_sort = off;
