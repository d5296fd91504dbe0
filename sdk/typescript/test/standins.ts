// Stand-ins for the model vendors' side (no model API is reachable from the tests): a local
// HTTP server that speaks enough of Anthropic's Messages API for the real `@anthropic-ai/sdk`
// client, answering from a script of turns; each turn sees the request the client sent.
import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";

export type Turn = (request: { model: string; messages: Array<{ role: string; content: any }>; tools?: any[] }) => unknown[];

export interface MessagesStandIn {
  url: string;
  requests: Array<Record<string, any>>;
  close(): Promise<void>;
}

/** Serves POST /v1/messages from `turns` in order (content blocks of each answer); 500 past the end. */
export async function messagesStandIn(turns: Turn[]): Promise<MessagesStandIn> {
  const requests: Array<Record<string, any>> = [];
  let n = 0;
  const server: Server = createServer((req, res) => {
    let body = "";
    req.on("data", (c) => (body += c));
    req.on("end", () => {
      const send = (status: number, v: unknown) => {
        res.writeHead(status, { "content-type": "application/json", "request-id": `req_${n}` });
        res.end(JSON.stringify(v));
      };
      if (req.method !== "POST" || !req.url?.startsWith("/v1/messages")) {
        return send(404, { type: "error", error: { type: "not_found_error", message: `${req.method} ${req.url}` } });
      }
      const r = JSON.parse(body);
      requests.push(r);
      const turn = turns[n++];
      if (!turn) return send(500, { type: "error", error: { type: "api_error", message: "the script has no more turns" } });
      let content: unknown[];
      try {
        content = turn(r);
      } catch (e) {
        return send(500, { type: "error", error: { type: "api_error", message: `the script's check failed: ${String(e)}` } });
      }
      const uses = content.some((b: any) => b.type === "tool_use");
      send(200, {
        id: `msg_${n}`,
        type: "message",
        role: "assistant",
        model: r.model,
        content,
        stop_reason: uses ? "tool_use" : "end_turn",
        stop_sequence: null,
        usage: { input_tokens: 1, output_tokens: 1 },
      });
    });
  });
  await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
  const { port } = server.address() as AddressInfo;
  return {
    url: `http://127.0.0.1:${port}`,
    requests,
    close: () => new Promise((ok) => server.close(() => ok())),
  };
}

let ids = 0;
/** A tool_use block. */
export function toolUse(name: string, input: unknown): { type: "tool_use"; id: string; name: string; input: unknown } {
  return { type: "tool_use", id: `toolu_${++ids}`, name, input };
}

/** The tool_result blocks of the last user message of a request. */
export function lastResults(r: { messages: Array<{ role: string; content: any }> }): Array<{ tool_use_id: string; content: string; is_error?: boolean }> {
  const m = r.messages[r.messages.length - 1]!;
  if (m.role !== "user" || !Array.isArray(m.content)) throw new Error(`the last message is not tool results: ${JSON.stringify(m)}`);
  return m.content;
}
