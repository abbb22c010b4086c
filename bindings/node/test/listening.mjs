// A node:http server on a free loopback port, for the tests that put an app behind one.

/** Listens on a free loopback port; resolves to { url, close }. */
export function listening(server) {
  return new Promise((resolve) => {
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address();
      resolve({ url: `http://127.0.0.1:${port}`, close: () => new Promise((done) => server.close(done)) });
    });
  });
}
