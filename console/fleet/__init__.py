"""Every host is a Host, this one too (`host`: the interface; `local`, `remote` over ssh, `fake`
for tests), every action defined once (`actions`) and run on any hosts by one runner (`runner`),
a fleet's hosts, readings and log together (`session`, `collector`, `watch`, `events`), the rows
of the fleet screen (`rows`), a service's logs across hosts (`logs`), and how hosts are named and
reached (`spec`, `ssh`, `flags`). Torch-free, no Textual: the console's screens and `dsv4 fleet`
both start actions here and render what they tell."""
